"""``nixl._bindings`` on kvrail: every name NIXL's Python users and tests take from it — the
bindings-level agent (``nixlAgent``, ``nixlAgentConfig``), descriptor lists, memory segment
and status constants, the exception types and ``nixlXferTelemetry``.

The ``nixl`` compat package (:mod:`kvrail.nixl_compat`) makes this very module
``nixl._bindings``, so what a program or a test sets on it (a wrapped ``nixlAgent``) is what
``nixl_agent`` (:mod:`kvrail.nixl`) uses.
"""

from __future__ import annotations

from ._nixl_bind_agent import nixlAgent, nixlAgentConfig
from ._nixl_types import *  # noqa: F401,F403
from ._nixl_types import __all__ as _types

__all__ = list(_types) + ["nixlAgent", "nixlAgentConfig"]
