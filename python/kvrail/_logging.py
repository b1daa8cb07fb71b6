"""kvrail's log records in Python's ``logging``: under the ``kvrail`` logger, named after the
Rust module (``kvrail.agent``, ``kvrail.connector.writer``, …). A daemon thread drains them
from the native module (which never takes the GIL to log). Records below the ``kvrail``
logger's effective level at import are not even made; call :func:`kvrail.set_log_level`
after changing it."""

from __future__ import annotations

import logging
import threading

from . import _kvrail

_root = logging.getLogger("kvrail")


def set_log_level(level: int | None = None) -> None:
    """Make records at ``level`` and above (default: the ``kvrail`` logger's effective
    level) on the Rust side."""
    _kvrail.set_log_level(int(level if level is not None else _root.getEffectiveLevel()))


def _pump() -> None:
    while True:
        try:
            records, dropped = _kvrail.take_logs(1.0)
        except Exception:  # interpreter shutting down
            return
        if dropped:
            _root.warning("%d kvrail log records were dropped (Python did not keep up)", dropped)
        for level, target, msg in records:
            name = target if target.startswith("kvrail") else f"kvrail.{target}"
            logging.getLogger(name).log(level, "%s", msg)


def start() -> None:
    """Set the level and start the draining thread (once, at import)."""
    set_log_level()
    threading.Thread(target=_pump, name="kvrail-logs", daemon=True).start()
