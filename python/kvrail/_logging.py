"""kvrail's log records in Python's ``logging``: under the ``kvrail`` logger, named after the
Rust module (``kvrail.agent``, ``kvrail.connector.writer``, …). A daemon thread drains them
from the native module (which never takes the GIL to log). Records below the ``kvrail``
logger's effective level at import are not even made; call :func:`kvrail.set_log_level`
after changing it."""

from __future__ import annotations

import atexit
import logging
import threading

from . import _kvrail

_root = logging.getLogger("kvrail")
_stop = threading.Event()
_thread: threading.Thread | None = None


def set_log_level(level: int | None = None) -> None:
    """Make records at ``level`` and above (default: the ``kvrail`` logger's effective
    level) on the Rust side."""
    _kvrail.set_log_level(int(level if level is not None else _root.getEffectiveLevel()))


def _emit(records, dropped) -> None:
    if dropped:
        _root.warning("%d kvrail log records were dropped (Python did not keep up)", dropped)
    for level, target, msg in records:
        name = target if target.startswith("kvrail") else f"kvrail.{target}"
        logging.getLogger(name).log(level, "%s", msg)


def _pump() -> None:
    while not _stop.is_set():
        try:
            records, dropped = _kvrail.take_logs(1.0)
        except Exception:  # interpreter shutting down
            return
        _emit(records, dropped)


def _shutdown() -> None:
    """At interpreter exit, before finalization: stop and join the draining thread, then
    hand on what is left. A daemon thread still waiting in the native module when the
    interpreter finalizes would be ended by Python mid-call, which aborts the process (see
    ``stop_logs`` in the native module)."""
    _stop.set()
    _kvrail.stop_logs()
    if _thread is not None:
        _thread.join(timeout=5.0)
    _emit(*_kvrail.take_logs(0.0))


def start() -> None:
    """Set the level and start the draining thread (once, at import)."""
    global _thread
    set_log_level()
    _thread = threading.Thread(target=_pump, name="kvrail-logs", daemon=True)
    _thread.start()
    atexit.register(_shutdown)
