"""``nixl.logging`` on kvrail: ``get_logger(name)`` gives the logger ``nixl.<name>`` (leading
underscores dropped), under a ``nixl`` logger that writes to standard output at INFO — or
at ``NIXL_LOG_LEVEL`` (TRACE, DEBUG, INFO, WARN, ERROR, FATAL) — as NIXL's does, so NIXL's
examples print what they report. It is set up once, on the first call."""

from __future__ import annotations

import logging
import os
import sys

_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}
_ready = False


def _setup() -> None:
    global _ready
    if _ready:
        return
    _ready = True
    root = logging.getLogger("nixl")
    env = os.environ.get("NIXL_LOG_LEVEL", "").strip().upper()
    level = _LEVELS.get(env, logging.INFO)
    if env and env not in _LEVELS:
        print(f"NIXL_LOG_LEVEL: {env!r} is not one of {', '.join(_LEVELS)}; INFO", file=sys.stderr)
    root.setLevel(level)
    if not root.handlers:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s", "%Y-%m-%d %H:%M:%S"))
        root.addHandler(h)
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    """The logger NIXL's modules, tests and examples use: ``nixl.<name>``."""
    _setup()
    return logging.getLogger(f"nixl.{name.lstrip('_')}")


__all__ = ["get_logger"]
