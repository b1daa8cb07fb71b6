"""Where an object's memory is: tensors (``data_ptr()``), numpy arrays (the array
interface), and writable buffers (the buffer protocol)."""

from __future__ import annotations

import ctypes
from typing import Any, Tuple

from ._kvrail import MisuseError


def buffer_span(obj: Any) -> Tuple[int, int, str, int]:
    """(address, length in bytes, memory type, device id) of ``obj``'s memory.

    Accepts an object with ``data_ptr()``, ``numel()`` and ``element_size()`` (a torch
    tensor: "VRAM" when ``obj.device.type`` is not "cpu"), one with ``__array_interface__``
    (a C-contiguous numpy array), or a writable buffer (bytearray, mmap). Raises
    :class:`MisuseError` for anything else, and for non-contiguous arrays.
    """
    if hasattr(obj, "data_ptr") and hasattr(obj, "numel") and hasattr(obj, "element_size"):
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise MisuseError("tensor: not contiguous (register contiguous memory)")
        dev = getattr(obj, "device", None)
        kind = "DRAM" if dev is None or getattr(dev, "type", "cpu") == "cpu" else "VRAM"
        dev_id = getattr(dev, "index", None) or 0
        return int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size()), kind, int(dev_id)
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        flags = getattr(obj, "flags", None)
        if flags is not None and not flags["C_CONTIGUOUS"]:
            raise MisuseError("array: not C-contiguous (register contiguous memory)")
        return int(ai["data"][0]), int(obj.nbytes), "DRAM", 0
    try:
        mv = memoryview(obj)
    except TypeError:
        raise MisuseError(
            f"memory: {type(obj).__name__} is not a tensor, an array or a buffer"
        ) from None
    if mv.readonly:
        raise MisuseError("buffer: read-only (kvrail writes into registered memory)")
    if not mv.c_contiguous:
        raise MisuseError("buffer: not contiguous")
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mv))
    return addr, mv.nbytes, "DRAM", 0
