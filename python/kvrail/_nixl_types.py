"""The vocabulary of ``nixl._bindings`` on kvrail: descriptor lists and their
constructors, memory segment and status constants, the exception types and
``nixlXferTelemetry``. The bindings-level agent (:mod:`kvrail._nixl_bind_agent`) and
:mod:`kvrail.nixl` use them; :mod:`kvrail._nixl_bindings` gathers both, and the ``nixl``
compat package (:mod:`kvrail.nixl_compat`) is that module under the name ``nixl._bindings``.

Each NIXL exception is also a :class:`kvrail.KvrailError` of the matching fault group.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Iterable, List, Tuple

from . import _kvrail
from ._kvrail import KvrailError, MisuseError, PeerConnectionError, PeerError
from ._memory import buffer_span

logger = logging.getLogger("kvrail.nixl")

DEFAULT_COMM_PORT = 8888
NIXL_INIT_AGENT = ""
HAVE_UCX_GPU_DEVICE_API = False


class nixl_mem_t(enum.IntEnum):
    """NIXL's memory segment types (kvrail moves DRAM and VRAM)."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_status_t(enum.IntEnum):
    """NIXL's status codes."""

    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9


class nixl_xfer_op_t(enum.IntEnum):
    """NIXL's transfer operations."""

    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_cost_t(enum.IntEnum):
    """How NIXL estimated a transfer's cost (kvrail does not estimate)."""

    NIXL_COST_ANALYTICAL_BACKEND = 0


class nixl_thread_sync_t(enum.Enum):
    """NIXL's thread synchronization modes (kvrail's agent is always thread safe)."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


globals().update({m.name: m for e in (nixl_mem_t, nixl_status_t, nixl_xfer_op_t, nixl_cost_t) for m in e})
NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT

# ---- exceptions ----------------------------------------------------------------------------


class nixlNotFoundError(MisuseError):
    """An unknown peer, handle, backend or registration (NIXL_ERR_NOT_FOUND)."""


class nixlInvalidParamError(MisuseError):
    """A bad argument (NIXL_ERR_INVALID_PARAM)."""


class nixlRepostActiveError(MisuseError):
    """A transfer posted again while still in progress (NIXL_ERR_REPOST_ACTIVE)."""


class nixlNotAllowedError(MisuseError):
    """A call in the wrong state (NIXL_ERR_NOT_ALLOWED)."""


class nixlNotPostedError(MisuseError):
    """A transfer asked about before it was posted (NIXL_ERR_NOT_POSTED)."""


class nixlNoTelemetryError(MisuseError):
    """Telemetry asked for while capture is off (NIXL_ERR_NO_TELEMETRY)."""


class nixlNotSupportedError(_kvrail.UnavailableError):
    """Something kvrail does not do (NIXL_ERR_NOT_SUPPORTED)."""


class nixlBackendError(KvrailError):
    """The transport failed (NIXL_ERR_BACKEND)."""


class nixlCancelledError(KvrailError):
    """A transfer was cancelled (NIXL_ERR_CANCELED)."""


class nixlUnknownError(KvrailError):
    """A failure of no other kind (NIXL_ERR_UNKNOWN)."""


class nixlRemoteDisconnectError(PeerConnectionError):
    """The peer is gone (NIXL_ERR_REMOTE_DISCONNECT)."""


class nixlMismatchError(PeerError):
    """The peer's metadata does not match (NIXL_ERR_MISMATCH)."""


# ---- memory types --------------------------------------------------------------------------

# NIXL's names for memory types (nixl_agent.nixl_mems) -> kvrail's, None where kvrail has none
_MEM_NAMES = {"DRAM": "DRAM", "cpu": "DRAM", "VRAM": "VRAM", "cuda": "VRAM", "FILE": None, "BLOCK": None, "OBJ": None}
_SEG_NAMES = {
    nixl_mem_t.DRAM_SEG: "DRAM",
    nixl_mem_t.VRAM_SEG: "VRAM",
    nixl_mem_t.BLK_SEG: None,
    nixl_mem_t.OBJ_SEG: None,
    nixl_mem_t.FILE_SEG: None,
}


def mem_kind(mem_type: Any) -> str:
    """kvrail's memory type ("DRAM" or "VRAM") for a NIXL name ("DRAM", "cuda", …) or a
    ``nixl_mem_t``. An unknown name raises KeyError, as in NIXL; a type NIXL knows and kvrail
    does not move (FILE, BLOCK, OBJ) raises :class:`nixlInvalidParamError`."""
    if isinstance(mem_type, nixl_mem_t):
        kind = _SEG_NAMES[mem_type]
    elif isinstance(mem_type, str) and mem_type in _MEM_NAMES:
        kind = _MEM_NAMES[mem_type]
    else:
        raise KeyError(mem_type)
    if kind is None:
        raise nixlInvalidParamError(f"mem_type: {mem_type!r} (kvrail moves DRAM and VRAM)")
    return kind


# ---- descriptor lists ----------------------------------------------------------------------


class _DList:
    """What every descriptor list answers: its memory type, length and entries."""

    mem_type: str
    descs: list

    def __init__(self, type: Any, descs: Any = 0, init_size: int = 0):  # noqa: A002 (NIXL's name)
        self.mem_type = mem_kind(type)
        self.descs = []
        for d in _rows(descs):
            self.append(d)

    def descCount(self) -> int:
        return len(self.descs)

    def isEmpty(self) -> bool:
        return not self.descs

    def getType(self) -> nixl_mem_t:
        return nixl_mem_t.VRAM_SEG if self.mem_type == "VRAM" else nixl_mem_t.DRAM_SEG

    def clear(self) -> None:
        self.descs.clear()

    def remDesc(self, index: int) -> None:
        del self.descs[index]

    def __len__(self) -> int:
        return len(self.descs)

    def __getitem__(self, i):
        return self.descs[i]

    def __setitem__(self, i, desc) -> None:
        self.descs[i] = self._entry(desc)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.mem_type == self.mem_type and other.descs == self.descs

    __hash__ = None  # type: ignore[assignment]  # mutable, as NIXL's

    def index(self, desc) -> int:
        """Where ``desc`` is in the list (``ValueError`` where it is not)."""
        return self.descs.index(self._entry(desc))

    def append(self, desc) -> None:
        """Add one descriptor (``addDesc`` in NIXL)."""
        self.descs.append(self._entry(desc))

    def addDesc(self, desc) -> None:
        """Add one descriptor (``append``)."""
        self.append(desc)

    def print(self) -> None:
        """Write the list to standard output, one descriptor a line, as NIXL's ``print``."""
        print(f"DescList of mem type {int(self.getType())}")
        for d in self.descs:
            print("  " + ", ".join(f"{x:#x}" if i == 0 else str(x) for i, x in enumerate(d)))

    def _entry(self, desc) -> tuple:
        raise NotImplementedError

    def __getstate__(self):
        return {"mem_type": self.mem_type, "descs": list(self.descs)}

    def __setstate__(self, st):
        self.mem_type, self.descs = st["mem_type"], list(st["descs"])


def _rows(descs: Any) -> Iterable:
    """Entries of a list, or the rows of an array; none for NIXL's ``init_size`` integer."""
    if descs is None or isinstance(descs, int):
        return ()
    return descs


class nixlRegDList(_DList):
    """A registration descriptor list: ``(address, length, device id, meta)`` entries of one
    memory type. ``nixlRegDList(DRAM_SEG, [(addr, len, dev, meta), …])`` as in NIXL (a memory
    type name such as "DRAM" works too); Nx3 array rows get empty metadata."""

    def __init__(self, type: Any, descs: Any = 0, owners=(), init_size: int = 0):  # noqa: A002 (NIXL's name)
        self.mem_type = mem_kind(type)
        self.descs: List[Tuple[int, int, int, str]] = []
        for d in _rows(descs):
            self.append(d)
        self._owners = list(owners)  # objects whose memory this is: kept alive

    def _entry(self, desc) -> tuple:
        if len(desc) not in (3, 4):
            raise nixlInvalidParamError(f"descriptor {desc!r}: (address, length, device id, meta) expected")
        a, n, d = (int(x) for x in desc[:3])
        meta = desc[3] if len(desc) > 3 else ""
        return (a, n, d, meta.decode() if isinstance(meta, (bytes, bytearray)) else str(meta))

    def __setstate__(self, st):
        super().__setstate__(st)
        self._owners = []

    def trim(self) -> "nixlXferDList":
        """The same memory as a transfer descriptor list."""
        return nixlXferDList(self.mem_type, [(a, n, d) for a, n, d, _ in self.descs])

    def __repr__(self) -> str:
        return f"nixlRegDList({self.mem_type}, {len(self.descs)} descriptors)"


class nixlXferDList(_DList):
    """A transfer descriptor list: ``(address, length, device id)`` entries of one memory
    type, ``nixlXferDList(DRAM_SEG, [...])`` as in NIXL."""

    def _entry(self, desc) -> tuple:
        if len(desc) != 3:
            raise nixlInvalidParamError(f"descriptor {desc!r}: (address, length, device id) expected")
        a, n, d = (int(x) for x in desc)
        return (a, n, d)

    def __repr__(self) -> str:
        return f"nixlXferDList({self.mem_type}, {len(self.descs)} descriptors)"


class nixlRemoteDList(_DList):
    """A descriptor list in a peer's memory: ``(address, length, device id, agent name)``
    entries, ``nixlRemoteDList(DRAM_SEG, [...])`` as in NIXL."""

    def _entry(self, desc) -> tuple:
        if len(desc) != 4:
            raise nixlInvalidParamError(f"descriptor {desc!r}: (address, length, device id, agent name) expected")
        a, n, d = (int(x) for x in desc[:3])
        name = desc[3]
        return (a, n, d, name.decode() if isinstance(name, (bytes, bytearray)) else str(name))

    def __repr__(self) -> str:
        return f"nixlRemoteDList({self.mem_type}, {len(self.descs)} descriptors)"


# ---- telemetry -----------------------------------------------------------------------------


class nixlXferTelemetry:
    """What ``get_xfer_telemetry`` reports of one transfer request, in NIXL's fields: times
    in microseconds (``startTime`` since the epoch, ``postDuration`` spent posting,
    ``xferDuration`` from posting until the completion was seen), ``totalBytes``,
    ``descCount`` and ``backendName`` (the NIXL backend name the request was made for;
    kvrail's own transport carried it)."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount", "backendName")

    def __init__(self) -> None:
        self.startTime = 0
        self.postDuration = 0
        self.xferDuration = 0
        self.totalBytes = 0
        self.descCount = 0
        self.backendName = ""

    def __repr__(self) -> str:
        return (
            f"nixlXferTelemetry(descCount={self.descCount}, totalBytes={self.totalBytes}, "
            f"startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, backendName={self.backendName!r})"
        )


# ---- descriptors from what NIXL's users pass ---------------------------------------------


def _dlist(descs, mem_type, cls, other, strict: bool):
    """``descs`` as a ``cls`` list (nixlRegDList: 4-tuples, nixlXferDList: 3-tuples). What
    NIXL's ``get_*_descs`` refuse with None and a log line is refused the same way, or with
    :class:`nixlInvalidParamError` naming the reason when ``strict`` (registration). An
    unknown memory type name raises KeyError, as in NIXL."""
    reg = cls is nixlRegDList

    def refuse(why: str, exc=nixlInvalidParamError):
        if strict:
            raise exc(why)
        logger.error("%s", why)
        return None

    if isinstance(descs, cls):
        return descs
    if isinstance(descs, other):
        return refuse(f"{other.__name__} type detected, please use {cls.__name__}")
    if isinstance(descs, (list, tuple)) and not descs:
        return cls(mem_kind(mem_type or "DRAM"), [])
    if _is_nx3(descs) or (isinstance(descs, (list, tuple)) and isinstance(descs[0], tuple)):
        width = 3 if _is_nx3(descs) else (4 if reg else 3)
        if mem_type is None:
            return refuse("Please specify a mem type if not using Tensors")
        kind = mem_kind(mem_type)
        if not _is_nx3(descs) and len(descs[0]) != width:
            return refuse(f"{width}-tuple list needed for {'registration' if reg else 'transfer'}")
        return cls(kind, descs)
    objs = descs if isinstance(descs, (list, tuple)) else [descs]
    try:
        spans = [buffer_span(o) for o in objs]
    except MisuseError as e:
        if strict:
            raise
        return refuse(f"Please use a list of contiguous Tensors ({e})")
    kinds = {s[2] for s in spans}
    if len(kinds) != 1:
        return refuse("descs: objects of different memory types")
    kind = mem_kind(mem_type) if mem_type is not None else kinds.pop()
    if reg:
        return nixlRegDList(kind, [(a, n, d, "") for a, n, _, d in spans], owners=objs)
    return nixlXferDList(kind, [(a, n, d) for a, n, _, d in spans])


def _op(operation: str) -> str:
    """A transfer operation; anything but "READ" and "WRITE" is a KeyError, as in NIXL."""
    if operation not in ("READ", "WRITE"):
        raise KeyError(operation)
    return operation


def _is_nx3(descs: Any) -> bool:
    shape = getattr(descs, "shape", None)
    return shape is not None and len(shape) == 2 and shape[1] == 3 and hasattr(descs, "dtype")


__all__ = [n for n in dir() if (n.startswith(("nixl", "NIXL_")) or n.endswith("_SEG"))] + [
    "DEFAULT_COMM_PORT",
    "HAVE_UCX_GPU_DEVICE_API",
]
