"""NIXL's bindings-level agent on kvrail: ``nixl._bindings.nixlAgent`` and
``nixlAgentConfig``, the objects NIXL's own tests and lower-level programs drive and that
``nixl_agent`` (:mod:`kvrail.nixl`) is built on.

Handles are integers (transfers, prepared lists, backends) and answers are
``nixl_status_t`` values, as in NIXL; a failure raises NIXL's exception of its kind with
kvrail's message. Everything moves on one ``kvrail._kvrail.Agent``: NIXL backend names map
to kvrail's own transport (verbs where a usable rail exists, TCP otherwise).

Metadata travels as in NIXL: bytes (``getLocalMD``/``loadRemoteMD``), a peer's listener
(``fetchRemoteMD``/``sendLocalMD``/``invalidateLocalMD`` with an address: kvrail's side
channel), or the metadata store (the same calls without an address, with
``NIXL_ETCD_ENDPOINTS``). Partial metadata (``getLocalPartialMD``) names only some regions; a
peer that loads it adds those regions to what it knew.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _kvrail
from ._kvrail import KvrailError, MisuseError, PeerConnectionError, PeerError
from ._nixl_types import (
    DEFAULT_COMM_PORT,
    NIXL_IN_PROG,
    NIXL_READ,
    NIXL_SUCCESS,
    NIXL_ERR_NOT_FOUND,
    nixl_status_t,
    nixl_thread_sync_t,
    nixl_xfer_op_t,
    nixlBackendError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlXferDList,
    nixlXferTelemetry,
)

logger = logging.getLogger("kvrail.nixl")

#: The NIXL backend names kvrail stands in for (each is kvrail's own transport).
PLUGINS = ("UCX", "UCX_MO", "LIBFABRIC", "UCCL", "Mooncake", "MOONCAKE", "GPUNETIO")
_MEMS = ["DRAM_SEG", "VRAM_SEG"]
_TRUE, _FALSE = ("y", "yes", "on", "1", "true"), ("n", "no", "off", "0", "false")

#: Partial metadata (``getLocalPartialMD``) is the agent's metadata behind this prefix: a
#: peer that loads it adds the regions it names instead of replacing what it knew.
PARTIAL_MAGIC = b"kvrail-partial-md\x00"


def translate(e: Exception) -> Exception:
    """A kvrail error as NIXL's exception of the same meaning (a configuration error stays
    kvrail's: it names the key, and NIXL has none of its own)."""
    msg = str(e)
    if isinstance(e, _kvrail.ConfigError):
        return e
    if isinstance(e, MisuseError):
        if any(k in msg for k in ("unknown peer", "no transfer", "no registered region", "not inside memory", "no agent ")):
            return nixlNotFoundError(msg)
        if "in progress" in msg:
            return nixlRepostActiveError(msg)
        return nixlInvalidParamError(msg)
    if isinstance(e, PeerConnectionError):
        return nixlRemoteDisconnectError(msg)
    if isinstance(e, PeerError):
        return nixlMismatchError(msg)
    if isinstance(e, _kvrail.UnavailableError):
        return nixlNotSupportedError(msg)
    if isinstance(e, KvrailError):
        return nixlBackendError(msg)
    return e


def _call(f, *args):
    try:
        return f(*args)
    except KvrailError as e:
        raise translate(e) from e


def _name(agent: Any) -> str:
    """An agent name as NIXL passes them: str, or the bytes ``loadRemoteMD`` returned."""
    return agent.decode() if isinstance(agent, (bytes, bytearray)) else str(agent)


def _bytes(msg: Any) -> bytes:
    return msg.encode() if isinstance(msg, str) else bytes(msg)


def _op(op: Any) -> str:
    if isinstance(op, str) and op in ("READ", "WRITE"):
        return op
    if isinstance(op, nixl_xfer_op_t) or op in (0, 1):
        return "READ" if int(op) == int(NIXL_READ) else "WRITE"
    raise nixlInvalidParamError(f"operation: {op!r} (NIXL_READ or NIXL_WRITE)")


def telemetry_on(capture: bool) -> bool:
    """NIXL's rule: ``NIXL_TELEMETRY_ENABLE`` (y/n) when set, else the config's choice."""
    env = os.environ.get("NIXL_TELEMETRY_ENABLE", "").strip().lower()
    if env in _TRUE:
        return True
    if env in _FALSE:
        return False
    return bool(capture)


class nixlAgentConfig:
    """NIXL's agent configuration, positionally as NIXL's: ``(useProgThread,
    useListenThread, listenPort, syncMode, pthrDelay, lthrDelay, etcdWatchTimeout,
    captureTelemetry)``. ``useListenThread`` with ``listenPort`` is kvrail's side channel on
    that port (0: any free port; without it the side channel takes a free port too: kvrail
    peers always fetch metadata there). ``kvrailConfig`` (kvrail's) holds kvrail's own agent
    keys. kvrail's agent is thread safe whatever ``syncMode`` says, and progresses on its
    own threads whatever ``useProgThread`` says; both are kept for the caller."""

    def __init__(
        self,
        useProgThread: bool = False,
        useListenThread: bool = False,
        listenPort: int = DEFAULT_COMM_PORT,
        syncMode: Any = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value,
        pthrDelay: int = 0,
        lthrDelay: int = 100000,
        etcdWatchTimeout: Any = datetime.timedelta(seconds=5),
        captureTelemetry: bool = False,
    ):
        self.useProgThread = bool(useProgThread)
        self.useListenThread = bool(useListenThread)
        self.listenPort = int(listenPort)
        self.syncMode = syncMode
        self.pthrDelay = int(pthrDelay)
        self.lthrDelay = int(lthrDelay)
        self.etcdWatchTimeout = etcdWatchTimeout
        self.captureTelemetry = bool(captureTelemetry)
        self.kvrailConfig: Dict[str, Any] = {}

    def __repr__(self) -> str:
        keys = ("useProgThread", "useListenThread", "listenPort", "syncMode", "captureTelemetry")
        return "nixlAgentConfig(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in keys) + ")"


def agent_json(conf: nixlAgentConfig) -> str:
    """kvrail's agent keys for ``conf``: ``KVRAIL_AGENT_CONFIG`` (JSON), then
    ``conf.kvrailConfig``, NIXL's etcd settings (``NIXL_ETCD_ENDPOINTS``,
    ``NIXL_ETCD_NAMESPACE``) as the metadata store, and the listener."""
    cfg: Dict[str, Any] = {}
    env = os.environ.get("KVRAIL_AGENT_CONFIG")
    if env:
        try:
            cfg.update(json.loads(env))
        except ValueError as e:
            raise _kvrail.ConfigError(f"KVRAIL_AGENT_CONFIG: not JSON: {e}") from None
    cfg.update(getattr(conf, "kvrailConfig", {}) or {})
    etcd = os.environ.get("NIXL_ETCD_ENDPOINTS")
    if etcd and "metadata_store" not in cfg:
        hosts = [e.strip().split("://", 1)[-1].rstrip("/") for e in etcd.split(",") if e.strip()]
        cfg["metadata_store"] = "etcd://" + ",".join(hosts)
        ns = os.environ.get("NIXL_ETCD_NAMESPACE")
        if ns and "metadata_namespace" not in cfg:
            cfg["metadata_namespace"] = ns.strip("/")
    listening = bool(getattr(conf, "useListenThread", False))
    if "listen" not in cfg:
        port = int(getattr(conf, "listenPort", 0)) if listening else 0
        cfg["listen"] = f"0.0.0.0:{port}"
    # NIXL's listener thread takes the metadata peers send to it
    if listening and "accept_sent_metadata" not in cfg:
        cfg["accept_sent_metadata"] = True
    return json.dumps(cfg)


class _Prepped:
    """A prepared descriptor list: whose memory ("" for local) and its (addr, len) entries."""

    __slots__ = ("peer", "descs")

    def __init__(self, peer: str, descs: List[Tuple[int, int]]):
        self.peer, self.descs = peer, descs


class nixlAgent:
    """NIXL's bindings-level agent on kvrail (see the module's docs)."""

    def __init__(self, name: str, config: nixlAgentConfig):
        if not name:
            raise ValueError("agent name: empty (peers address an agent by its name)")
        self._agent = _call(_kvrail.Agent, str(name), agent_json(config))
        self._name = str(name)
        self._telemetry_on = telemetry_on(getattr(config, "captureTelemetry", False))
        self._backends: Dict[int, Tuple[str, Dict[str, str]]] = {}
        self._regs: Dict[Tuple[int, int], int] = {}  # (addr, len) -> region id
        self._prepped: Dict[int, _Prepped] = {}
        self._next_prepped = 1
        self._telemetry: Dict[int, nixlXferTelemetry] = {}

    @property
    def kvrail(self) -> "_kvrail.Agent":
        """(kvrail) The kvrail agent underneath."""
        return self._agent

    # ---- plugins and backends ----------------------------------------------------------

    def getAvailPlugins(self) -> List[str]:
        return list(PLUGINS)

    def getPluginParams(self, plugin: str) -> Tuple[Dict[str, str], List[str]]:
        """(options, memory types) of a plugin; one kvrail does not stand in for (a storage
        plugin such as POSIX, GDS or MOCK_DRAM) is :class:`nixlNotFoundError`."""
        if plugin not in PLUGINS:
            raise nixlNotFoundError(
                f"plugin {plugin!r}: kvrail moves memory between agents and stands in for {', '.join(PLUGINS)} "
                "(no storage plugins)"
            )
        return {}, list(_MEMS)

    def createBackend(self, plugin: str, params: Dict[str, str]) -> int:
        """A backend handle for a NIXL backend name (the same handle again for a name
        already created)."""
        self.getPluginParams(plugin)
        for h, (p, _) in self._backends.items():
            if p == plugin:
                return h
        h = len(self._backends) + 1
        self._backends[h] = (plugin, {str(k): str(v) for k, v in (params or {}).items()})
        logger.info("NIXL backend %s maps to kvrail's own transport: %s", plugin, self._agent.backend)
        return h

    def getBackendParams(self, backend: int) -> Tuple[Dict[str, str], List[str]]:
        if backend not in self._backends:
            raise nixlNotFoundError(f"backend handle {backend!r}: not created here")
        return dict(self._backends[backend][1]), list(_MEMS)

    def backend_name(self, backend: int) -> str:
        """(kvrail) The NIXL name a backend handle was created for."""
        return self._backends[backend][0] if backend in self._backends else "UCX"

    # ---- memory ------------------------------------------------------------------------

    def registerMem(self, descs: nixlRegDList, backends: Sequence[int] = ()) -> nixl_status_t:
        """Register every descriptor in place; all or nothing."""
        done: List[Tuple[int, int]] = []
        try:
            for a, n, d, _ in descs.descs:
                self._regs[(a, n)] = self._agent.register(a, n, descs.mem_type, d)
                done.append((a, n))
        except KvrailError as e:
            for k in done:
                self._agent.deregister(self._regs.pop(k))
            raise translate(e) from e
        return NIXL_SUCCESS

    def deregisterMem(self, descs: nixlRegDList, backends: Sequence[int] = ()) -> nixl_status_t:
        """Deregister what ``registerMem`` registered (refused while a transfer uses it);
        nothing is deregistered when one of them is not registered."""
        keys = [(a, n) for a, n, _, _ in descs.descs]
        for a, n in keys:
            if (a, n) not in self._regs:
                raise nixlNotFoundError(f"descs: [{a:#x}, +{n}) is not registered")
        for k in keys:
            _call(self._agent.deregister, self._regs[k])
            del self._regs[k]
        return NIXL_SUCCESS

    def registered(self, addr: int, length: int) -> bool:
        """(kvrail) Whether ``[addr, +length)`` was registered as one descriptor."""
        return (addr, length) in self._regs

    def queryMem(self, descs: nixlRegDList, backend: int) -> List[Optional[Dict[str, str]]]:
        """For each descriptor, ``{}`` where it is registered here, else None (kvrail has
        no storage to ask about)."""
        return [{} if (a, n) in self._regs else None for a, n, _, _ in descs.descs]

    # ---- metadata ----------------------------------------------------------------------

    def getLocalMD(self) -> bytes:
        return _call(self._agent.metadata)

    def getLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool = False, backends: Sequence[int] = ()) -> bytes:
        """Metadata naming only the regions ``descs`` lie in (none: connection details
        only). kvrail's metadata always carries how to connect, so ``inc_conn_info`` only
        says whether a peer may load it without knowing this agent yet."""
        ranges = [(a, n) for a, n, _, _ in descs.descs]
        md = _call(self._agent.partial_metadata, ranges)
        return PARTIAL_MAGIC + (b"\x01" if inc_conn_info else b"\x00") + md

    def loadRemoteMD(self, metadata: bytes) -> bytes:
        """Load a peer's metadata (full or partial) and connect; its name as bytes."""
        return _call(self.load_md, bytes(metadata)).encode()

    def load_md(self, md: bytes) -> str:
        """(kvrail) Load full or partial metadata; the peer's name."""
        if md.startswith(PARTIAL_MAGIC):
            conn, body = md[len(PARTIAL_MAGIC)], md[len(PARTIAL_MAGIC) + 1 :]
            return self._agent.load_partial(body, bool(conn))
        return self._agent.load_remote(md)

    def fetchRemoteMD(self, remote_agent: str, ip_addr: str = "", port: int = 0, label: str = "") -> None:
        """Load a peer's metadata from its listener at ``ip_addr:port`` (kvrail's side
        channel) or, without an address, from the metadata store (``label``: a partial
        metadata it published under that label)."""
        name = _name(remote_agent)
        if ip_addr:
            got = _call(self._agent.load_remote_addr, f"{ip_addr}:{port}")
            if name and got != name:
                raise nixlMismatchError(f"{ip_addr}:{port} is agent {got!r}, not {name!r}")
            return
        self._need_store("fetchRemoteMD")
        if label:
            _call(self._agent.load_label, name, label)
            return
        _call(self._agent.load_by_name, name)

    def sendLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        """Send this agent's metadata to the listener at ``ip_addr:port`` (the peer loads it
        and connects back), or without an address publish it in the metadata store."""
        if ip_addr:
            _call(self._agent.send_metadata, f"{ip_addr}:{port}", None)
            return
        self._need_store("sendLocalMD")
        self._agent.publish_metadata()

    def sendLocalPartialMD(
        self,
        descs: nixlRegDList,
        inc_conn_info: bool = False,
        backends: Sequence[int] = (),
        ip_addr: str = "",
        port: int = 0,
        label: str = "",
    ) -> None:
        """``getLocalPartialMD`` sent to a listener, or published in the metadata store
        under ``label`` (a label is needed there: NIXL's rule)."""
        md = self.getLocalPartialMD(descs, inc_conn_info, backends)
        if ip_addr:
            _call(self._agent.send_metadata, f"{ip_addr}:{port}", md[len(PARTIAL_MAGIC) + 1 :])
            return
        self._need_store("sendLocalPartialMD")
        if not label:
            raise nixlInvalidParamError("label: partial metadata in the metadata store needs a label")
        _call(self._agent.publish_partial, label, md[len(PARTIAL_MAGIC) + 1 :])

    def invalidateLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        """Tell the listener at ``ip_addr:port`` to forget this agent, or without an
        address withdraw this agent's metadata from the metadata store."""
        if ip_addr:
            _call(self._agent.send_invalidate, f"{ip_addr}:{port}")
            return
        self._need_store("invalidateLocalMD")
        _call(self._agent.unpublish_metadata)

    def invalidateRemoteMD(self, remote_agent: str) -> nixl_status_t:
        """Forget a peer (its connection closes); NIXL_ERR_NOT_FOUND for one not known."""
        name = _name(remote_agent)
        if not self._agent.has_peer(name):
            return NIXL_ERR_NOT_FOUND
        _call(self._agent.invalidate, name)
        return NIXL_SUCCESS

    def checkRemoteMD(self, remote_agent: str, descs: nixlXferDList) -> nixl_status_t:
        """NIXL_SUCCESS where the peer's metadata is loaded and covers every descriptor of
        ``descs``, else NIXL_ERR_NOT_FOUND."""
        name = _name(remote_agent)
        ranges = [(d[0], d[1]) for d in descs.descs]
        return NIXL_SUCCESS if self._agent.covers(name, ranges) else NIXL_ERR_NOT_FOUND

    def makeConnection(self, remote_agent: str, backends: Sequence[int] = ()) -> nixl_status_t:
        """kvrail connects when the metadata is loaded: checks the peer is known."""
        name = _name(remote_agent)
        if not self._agent.has_peer(name):
            raise nixlNotFoundError(f"unknown peer {name!r}: load its metadata first")
        return NIXL_SUCCESS

    def _need_store(self, what: str) -> None:
        if self._agent.store_up() is None:
            raise nixlNotSupportedError(
                f"{what}: no address given and no metadata store configured (NIXL_ETCD_ENDPOINTS or metadata_store)"
            )

    # ---- transfers ---------------------------------------------------------------------

    def prepXferDlist(self, *args, **kwargs) -> int:
        """A prepared list, in NIXL's three forms: ``(agent_name, descs, backend=[])`` (local
        memory for NIXL_INIT_AGENT, ""), ``(descs, backend=[])`` (local memory), and
        ``(agent_name, mem_type, descs, backend=[])``."""
        args = list(args)
        local_form = (args and isinstance(args[0], nixlXferDList)) or (not args and "agent_name" not in kwargs)
        if local_form:
            name = ""
        else:
            name = _name(args.pop(0) if args else kwargs.pop("agent_name"))
            if "mem_type" in kwargs:
                del kwargs["mem_type"]  # the list says its own memory type
            elif len(args) >= 3 or (len(args) == 2 and isinstance(args[1], nixlXferDList)):
                args.pop(0)
        descs = args.pop(0) if args else kwargs.pop("descs", None)
        if not isinstance(descs, nixlXferDList):
            raise nixlInvalidParamError(f"descs: a nixlXferDList (got {type(descs).__name__})")
        local = name in ("", "NIXL_INIT_AGENT")
        if not local and name != self._name and not self._agent.has_peer(name):
            raise nixlNotFoundError(f"unknown peer {name!r}: load its metadata first")
        h = self._next_prepped
        self._next_prepped += 1
        self._prepped[h] = _Prepped("" if local else name, [(d[0], d[1]) for d in descs.descs])
        return h

    def releasedDlistH(self, handle: int) -> nixl_status_t:
        if self._prepped.pop(int(handle), None) is None:
            raise nixlNotFoundError(f"prepared list {handle!r}: not prepared here or released")
        return NIXL_SUCCESS

    def makeXferReq(
        self,
        operation: Any,
        local_side: int,
        local_indices: Sequence[int],
        remote_side: int,
        remote_indices: Sequence[int],
        notif_msg: Any = "",
        backend: Sequence[int] = (),
        skip_desc_merg: bool = False,
    ) -> int:
        """A transfer of the chosen entries of two prepared lists (kvrail merges nothing:
        each descriptor is posted as given)."""
        op = _op(operation)
        sides = []
        for h, what in ((local_side, "local_side"), (remote_side, "remote_side")):
            p = self._prepped.get(int(h))
            if p is None:
                raise nixlInvalidParamError(f"{what}: {h!r} is not a prepared list (released?)")
            sides.append(p)
        try:
            local = [sides[0].descs[int(i)] for i in local_indices]
            remote = [sides[1].descs[int(i)] for i in remote_indices]
        except IndexError:
            raise nixlInvalidParamError("indices: outside the prepared list") from None
        return self._create(op, local, sides[1].peer, remote, notif_msg)

    def createXferReq(
        self,
        operation: Any,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: str,
        notif_msg: Any = "",
        backend: Sequence[int] = (),
    ) -> int:
        """A transfer between two descriptor lists; its handle (never 0)."""
        op = _op(operation)
        local = [(d[0], d[1]) for d in local_descs.descs]
        remote = [(d[0], d[1]) for d in remote_descs.descs]
        return self._create(op, local, _name(remote_agent), remote, notif_msg)

    def _create(self, op: str, local, peer: str, remote, notif_msg) -> int:
        msg = _bytes(notif_msg or b"")
        x = _call(self._agent.create_xfer, op, local, peer, remote, msg or None)
        tel = nixlXferTelemetry()
        tel.descCount, tel.totalBytes = len(local), sum(n for _, n in local)
        tel.backendName = self.backend_name(next(iter(self._backends), 0))
        self._telemetry[x] = tel
        return x

    def postXferReq(self, reqh: int, notif_msg: Any = "") -> nixl_status_t:
        """Post (again, once done); NIXL_SUCCESS or NIXL_IN_PROG. A transfer that cannot be
        posted raises, as in NIXL."""
        handle = reqh
        t0 = time.time_ns()
        if notif_msg:
            _call(self._agent.set_notif, int(handle), _bytes(notif_msg))
        _call(self._agent.post, int(handle))
        tel = self._telemetry.get(int(handle))
        if tel is not None:
            tel.startTime = t0 // 1000
            tel.postDuration = max(1, (time.time_ns() - t0) // 1000)
            tel.xferDuration = 0
        return self.getXferStatus(handle)

    def getXferStatus(self, handle: int) -> nixl_status_t:
        """NIXL_SUCCESS (done), NIXL_IN_PROG, or the transfer's failure raised."""
        st = _call(self._agent.status, int(handle))
        if st == "ERR":
            err = self._agent.error(int(handle))
            raise translate(err) if err is not None else nixlBackendError(f"transfer {handle:#x} failed")
        if st == "DONE":
            tel = self._telemetry.get(int(handle))
            if tel is not None and tel.startTime and not tel.xferDuration:
                tel.xferDuration = max(tel.postDuration, time.time_ns() // 1000 - tel.startTime)
            return NIXL_SUCCESS
        return NIXL_IN_PROG

    def getXferTelemetry(self, reqh: int) -> nixlXferTelemetry:
        """What the transfer did (needs ``captureTelemetry`` or ``NIXL_TELEMETRY_ENABLE``,
        else :class:`nixlNoTelemetryError`); ``xferDuration`` is 0 until its completion is
        seen by ``getXferStatus``."""
        handle = reqh
        if not self._telemetry_on:
            raise nixlNoTelemetryError("telemetry is off: captureTelemetry or NIXL_TELEMETRY_ENABLE=y")
        tel = self._telemetry.get(int(handle))
        if tel is None:
            raise nixlNotFoundError(f"no transfer {handle!r} (released?)")
        if not tel.startTime:
            raise nixlNotPostedError(f"transfer {handle:#x} was not posted")
        out = nixlXferTelemetry()
        for k in nixlXferTelemetry.__slots__:
            setattr(out, k, getattr(tel, k))
        return out

    def releaseXferReq(self, handle: int) -> nixl_status_t:
        """Release a transfer (refused while it is in progress)."""
        _call(self._agent.release, int(handle))
        self._telemetry.pop(int(handle), None)
        return NIXL_SUCCESS

    def queryXferBackend(self, handle: int) -> int:
        if int(handle) not in self._telemetry:
            raise nixlNotFoundError(f"no transfer {handle!r}")
        return next(iter(self._backends), 0)

    def estimateXferCost(self, req_handle: int) -> Tuple[int, int, int]:
        raise nixlNotSupportedError("estimateXferCost: kvrail has no cost model")

    def prepMemView(self, *args, **kwargs) -> int:
        raise nixlNotSupportedError("prepMemView: needs UCX's GPU device API (kvrail has none)")

    def releaseMemView(self, mvh: int) -> None:
        raise nixlNotSupportedError("releaseMemView: needs UCX's GPU device API (kvrail has none)")

    def xfer_error(self, handle: int) -> Optional[Exception]:
        """(kvrail) Why a transfer failed, else None."""
        return self._agent.error(int(handle))

    # ---- notifications -----------------------------------------------------------------

    def getNotifs(self, notif_map: Dict[str, List[bytes]], backends: Sequence[int] = ()) -> Dict[str, List[bytes]]:
        """``notif_map`` with the notifications that arrived since the last call added
        (peer name -> messages, in arrival order)."""
        out = {k: list(v) for k, v in (notif_map or {}).items()}
        for peer, msg in self._agent.get_new_notifs():
            out.setdefault(peer, []).append(msg)
        return out

    def genNotif(self, remote_agent: str, msg: Any, backends: Sequence[int] = ()) -> nixl_status_t:
        """Send a notification to a peer."""
        _call(self._agent.send_notif, _name(remote_agent), _bytes(msg))
        return NIXL_SUCCESS

    def __repr__(self) -> str:
        return f"nixlAgent({self._name!r}, {self._agent.backend})"


__all__ = ["nixlAgent", "nixlAgentConfig"]
