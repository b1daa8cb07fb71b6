"""kvrail: KV-cache blocks between prefill and decode engines over RDMA verbs (raw RC queue
pairs, multi-rail) or TCP — NIXL's semantics without libnixl or UCX.

Modules:

* :mod:`kvrail.nixl` — NIXL's Python agent API (``nixl_agent``) on kvrail: swap the import.
* :mod:`kvrail.vllm` — a vLLM ``KVConnectorBase_V1`` connector (push, pull, leases).

Errors are :class:`KvrailError` and its subclasses, one per fault group: what to fix
(:class:`MisuseError`, :class:`ConfigError` naming the key), whom to blame
(:class:`PeerError`, :class:`PeerConnectionError`, :class:`RdmaError`,
:class:`MemoryRegionError`), what this host lacks (:class:`UnavailableError`), or silence
(:class:`DeadlineError`).

Logs go to Python's ``logging`` under the ``kvrail`` logger (``kvrail.agent``, …); set its
level before importing kvrail, or call :func:`set_log_level` after changing it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from ._kvrail import (
    Agent as _NativeAgent,
    ConfigError,
    DeadlineError,
    KvrailError,
    MemoryRegionError,
    MisuseError,
    PeerConnectionError,
    PeerError,
    RdmaError,
    UnavailableError,
    __version__,
)
from ._logging import set_log_level, start as _start_logs
from ._memory import buffer_span

_start_logs()

__all__ = [
    "Agent",
    "ConfigError",
    "DeadlineError",
    "KvrailError",
    "MemoryRegionError",
    "MisuseError",
    "PeerConnectionError",
    "PeerError",
    "RdmaError",
    "UnavailableError",
    "__version__",
    "buffer_span",
    "set_log_level",
]


def Agent(name: str, config: Optional[Mapping[str, Any]] = None) -> _NativeAgent:
    """A kvrail agent called ``name``.

    ``config`` keys: ``listen`` ("ip:port" of the side channel), ``side_channel_host`` (the
    address advertised to peers), ``backend`` ("auto", "verbs", "tcp"), ``stripe_width``
    (None or 0), ``devices`` (RDMA devices), ``numa``, ``enforce_handshake_compat``,
    ``model``, ``dtype``, ``attn_backend``, ``draft_model``, ``kv_layout``, ``block_size``,
    ``cluster_secret`` and ``insecure`` (without a secret only loopback peers are served
    unless ``insecure`` is true), and the rest of the agent's JSON keys.
    An unknown key or bad value raises :class:`ConfigError` naming the key.
    """
    return _NativeAgent(name, json.dumps(dict(config)) if config else None)
