"""NIXL's Python agent API (``nixl._api``) on kvrail: a program written for NIXL runs
unchanged when its import is swapped::

    from kvrail.nixl import nixl_agent, nixl_agent_config

Descriptors are NIXL's: ``(address, length, device id[, meta])`` in memory registered with
the agent, "DRAM" or "VRAM" (NPU memory through the RBLN runtime). NIXL backend names
("UCX", …) are accepted and mapped to kvrail's own transport choice — RDMA verbs where a
usable rail exists, TCP otherwise — with a log line. kvrail's own agent keys can be given as
``nixl_agent_config(kvrail_config={...})`` or as JSON in the ``KVRAIL_AGENT_CONFIG``
environment variable (e.g. ``{"side_channel_host": "10.0.0.5"}`` for peers on other hosts).

Errors are NIXL's exception names (``nixlNotFoundError`` for an unknown peer, …), each also a
:class:`kvrail.KvrailError` of the matching fault group.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _kvrail
from ._amx import request_amx_permission
from ._kvrail import KvrailError, MisuseError, PeerConnectionError, PeerError
from ._nixl_bindings import (
    _dlist,
    _op,
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    nixl_thread_sync_t,
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
    nixlXferDList,
    nixlXferTelemetry,
)

logger = logging.getLogger("kvrail.nixl")

_NIXL_BACKENDS = ("UCX", "UCX_MO", "LIBFABRIC", "UCCL", "Mooncake", "MOONCAKE", "GPUNETIO")
_TRUE, _FALSE = ("y", "yes", "on", "1", "true"), ("n", "no", "off", "0", "false")

# vLLM's NixlConnector runs on this module (the compat package): vLLM's CPU attention uses AMX
# tiles without asking Linux for them (see kvrail._amx)
request_amx_permission()


def _name(agent: Union[str, bytes]) -> str:
    """An agent name as NIXL passes them: str, or the bytes ``add_remote_agent`` returned."""
    return agent.decode() if isinstance(agent, (bytes, bytearray)) else str(agent)


def _telemetry_on(conf: "nixl_agent_config") -> bool:
    """NIXL's rule: ``NIXL_TELEMETRY_ENABLE`` (y/n) when set, else ``capture_telemetry``."""
    env = os.environ.get("NIXL_TELEMETRY_ENABLE", "").strip().lower()
    if env in _TRUE:
        return True
    if env in _FALSE:
        return False
    return bool(conf.capture_telemetry)


class nixl_prepped_dlist_handle:
    """A descriptor list prepared for ``make_prepped_xfer`` (``prep_xfer_dlist``)."""

    __slots__ = ("_agent", "_peer", "_descs", "_released")

    def __init__(self, agent: "nixl_agent", peer: str, descs: List[Tuple[int, int]]):
        self._agent, self._peer, self._descs, self._released = agent, peer, descs, False

    def release(self) -> None:
        self._released = True

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle({self._peer or 'local'}, {len(self._descs)}, released={self._released})"


class nixl_xfer_handle:
    """A transfer request (``initialize_xfer`` / ``make_prepped_xfer``)."""

    __slots__ = ("_agent", "_handle", "_released")

    def __init__(self, agent: "nixl_agent", value: int):
        self._agent, self._handle, self._released = agent, int(value), False

    def release(self) -> None:
        if not self._released:
            self._agent._release_xfer(self._handle)
            self._released = True

    def __del__(self):
        if not getattr(self, "_released", True):
            try:
                self.release()
            except Exception:  # the agent is gone or the transfer still active
                pass

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"


nixl_backend_handle = int


class nixl_agent_config:
    """NIXL's agent configuration. ``enable_listen_thread``/``listen_port`` become kvrail's
    side channel (peers fetch metadata there with ``fetch_remote_metadata``);
    ``kvrail_config`` (a kvrail extension) passes kvrail's own agent keys;
    ``capture_telemetry`` (or ``NIXL_TELEMETRY_ENABLE``) turns on ``get_xfer_telemetry``;
    ``sync_mode`` is checked and kept (kvrail's agent is thread safe in every mode)."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: Sequence[str] = ("UCX",),
        sync_mode: Optional[nixl_thread_sync_t] = None,
        kvrail_config: Optional[Dict[str, Any]] = None,
    ):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.backends = list(backends)
        self.sync_mode = sync_mode
        self.kvrail_config = dict(kvrail_config or {})


def _translate(e: Exception) -> Exception:
    """A kvrail error as NIXL's exception of the same meaning."""
    msg = str(e)
    if isinstance(e, _kvrail.ConfigError):
        return e  # names the key; NIXL has no configuration error of its own
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


class nixl_agent:
    """A NIXL agent on kvrail: register memory, exchange metadata, READ and WRITE
    descriptor lists with notifications."""

    def __init__(
        self,
        agent_name: str,
        nixl_conf: Optional[nixl_agent_config] = None,
        instantiate_all: bool = False,
    ):
        if not agent_name:
            raise ValueError("agent_name: empty (peers address an agent by its name)")
        conf = nixl_conf or nixl_agent_config()
        if nixl_conf is not None and instantiate_all:
            logger.warning("Ignoring instantiate_all based on the provided config in agent creation.")
            instantiate_all = False
        cfg: Dict[str, Any] = {}
        env = os.environ.get("KVRAIL_AGENT_CONFIG")
        if env:
            try:
                cfg.update(json.loads(env))
            except ValueError as e:
                raise _kvrail.ConfigError(f"KVRAIL_AGENT_CONFIG: not JSON: {e}") from None
        cfg.update(conf.kvrail_config)
        # NIXL's etcd metadata server settings: kvrail's metadata store
        etcd = os.environ.get("NIXL_ETCD_ENDPOINTS")
        if etcd and "metadata_store" not in cfg:
            hosts = [e.strip().split("://", 1)[-1].rstrip("/") for e in etcd.split(",") if e.strip()]
            cfg["metadata_store"] = "etcd://" + ",".join(hosts)
            ns = os.environ.get("NIXL_ETCD_NAMESPACE")
            if ns and "metadata_namespace" not in cfg:
                cfg["metadata_namespace"] = ns.strip("/")
        if "listen" not in cfg:
            cfg["listen"] = f"0.0.0.0:{conf.port if conf.enable_listen else 0}"
        try:
            self._agent = _kvrail.Agent(agent_name, json.dumps(cfg))
        except KvrailError as e:
            raise _translate(e) from e
        self.name = agent_name
        self.notifs: Dict[str, List[bytes]] = {}
        self.backends: Dict[str, int] = {}
        self.backend_mems: Dict[str, List[str]] = {}
        self.backend_options: Dict[str, Dict[str, str]] = {}
        self.plugin_list = list(_NIXL_BACKENDS)
        # (addr, len) of each registered descriptor -> (region id, owners)
        self._regs: Dict[Tuple[int, int], int] = {}
        self._owners: Dict[Tuple[int, int], Any] = {}
        self._xfers: Dict[int, str] = {}  # transfer -> peer
        self._telemetry_on = _telemetry_on(conf)
        self._telemetry: Dict[int, nixlXferTelemetry] = {}  # transfer -> what it did
        for b in self.plugin_list if instantiate_all else conf.backends:
            if b in self.plugin_list:
                self.create_backend(b, {})
            else:
                logger.warning("Skipping backend registration %s due to the missing plugin.", b)
        logger.info("Initialized kvrail agent %s (backend %s)", agent_name, self._agent.backend)

    # ---- backends ----------------------------------------------------------------------

    def get_plugin_list(self) -> List[str]:
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> List[str]:
        """The memory types behind a NIXL backend name; empty (with a warning) for a name
        kvrail does not stand in for, as in NIXL."""
        if backend not in self.plugin_list:
            logger.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return ["DRAM", "VRAM"]

    def get_plugin_params(self, backend: str) -> Dict[str, str]:
        if backend not in self.plugin_list:
            logger.warning("Plugin %s is not available to get its parameters.", backend)
        return {}

    def get_backend_mem_types(self, backend: str) -> List[str]:
        if backend not in self.backend_mems:
            logger.warning("Backend %s not instantiated to get its supported mem types.", backend)
            return []
        return self.backend_mems[backend]

    def get_backend_params(self, backend: str) -> Dict[str, str]:
        if backend not in self.backend_options:
            logger.warning("Backend %s not instantiated to get its parameters.", backend)
            return {}
        return self.backend_options[backend]

    def create_backend(self, backend: str, initParams: Optional[Dict[str, str]] = None) -> None:
        """Accept a NIXL backend name; kvrail's transport (verbs or TCP) does the work."""
        if backend not in self.plugin_list:
            raise nixlNotFoundError(
                f"backend: {backend!r} is not a NIXL backend kvrail stands in for ({', '.join(self.plugin_list)})"
            )
        if backend in self.backends:
            return
        self.backends[backend] = len(self.backends) + 1
        self.backend_mems[backend] = ["DRAM", "VRAM"]
        self.backend_options[backend] = {str(k): str(v) for k, v in (initParams or {}).items()}
        logger.info(
            "NIXL backend %s maps to kvrail's own transport: %s", backend, self._agent.backend
        )

    # ---- memory ------------------------------------------------------------------------

    def get_reg_descs(self, descs, mem_type: Optional[str] = None) -> Optional[nixlRegDList]:
        """A registration list from 4-tuples (with ``mem_type``), an Nx3 array, a tensor or
        array or buffer, a list of those, or a nixlRegDList."""
        return _dlist(descs, mem_type, nixlRegDList, nixlXferDList, strict=False)

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None) -> Optional[nixlXferDList]:
        """A transfer list from 3-tuples (with ``mem_type``), an Nx3 array, a tensor or array
        or buffer, a list of those, or a nixlXferDList."""
        return _dlist(descs, mem_type, nixlXferDList, nixlRegDList, strict=False)

    def register_memory(self, reg_list, mem_type: Optional[str] = None, backends: Sequence[str] = ()) -> nixlRegDList:
        """Register memory in place (kvrail never copies it on RDMA); returns the list for
        ``deregister_memory``. The objects given stay referenced until then."""
        reg = _dlist(reg_list, mem_type, nixlRegDList, nixlXferDList, strict=True)
        done: List[Tuple[int, int]] = []
        try:
            for a, n, d, _ in reg.descs:
                rid = self._agent.register(a, n, reg.mem_type, d)
                self._regs[(a, n)] = rid
                done.append((a, n))
        except KvrailError as e:
            for k in done:
                self._agent.deregister(self._regs.pop(k))
            raise _translate(e) from e
        for k in done:
            self._owners[k] = reg._owners
        return reg

    def deregister_memory(self, dereg_list: nixlRegDList, backends: Sequence[str] = ()) -> None:
        """Deregister what ``register_memory`` registered (refused while a transfer uses it)."""
        for a, n, _, _ in dereg_list.descs:
            rid = self._regs.get((a, n))
            if rid is None:
                raise nixlNotFoundError(f"dereg_list: [{a:#x}, +{n}) is not registered")
            try:
                self._agent.deregister(rid)
            except KvrailError as e:
                raise _translate(e) from e
            del self._regs[(a, n)]
            self._owners.pop((a, n), None)

    def query_memory(self, reg_list, backend: str, mem_type: Optional[str] = None) -> List[Optional[Dict[str, str]]]:
        reg = self.get_reg_descs(reg_list, mem_type)
        return [{} if (a, n) in self._regs else None for a, n, _, _ in reg.descs]

    # ---- metadata and peers ------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        return self._agent.metadata()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's metadata (from its ``get_agent_metadata``) and connect; returns the
        peer's name as bytes, as NIXL does (every call takes it as bytes or str)."""
        try:
            return self._agent.load_remote(bytes(metadata)).encode()
        except KvrailError as e:
            raise _translate(e) from e

    def remove_remote_agent(self, agent: Union[str, bytes]) -> None:
        """Forget a peer (its connection closes); an unknown name is ignored, as in NIXL."""
        name = _name(agent)
        if not self._agent.has_peer(name):
            logger.warning("remove_remote_agent: no peer %r", name)
            return
        try:
            self._agent.invalidate(name)
        except KvrailError as e:
            raise _translate(e) from e

    def make_connection(self, remote_agent: Union[str, bytes], backends: Sequence[str] = ()) -> None:
        """kvrail connects when the metadata is loaded: only checks the peer is known."""
        remote_agent = _name(remote_agent)
        if not self._agent.has_peer(remote_agent):
            raise nixlNotFoundError(f"unknown peer {remote_agent!r}: load its metadata first")

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        """Load the metadata of the peer listening (``enable_listen_thread``) at ip:port, or
        with no address, by name from the metadata store (etcd: ``NIXL_ETCD_ENDPOINTS`` or
        the ``metadata_store`` key)."""
        if not ip_addr:
            if self._agent.store_up() is None:
                raise nixlNotSupportedError(
                    "ip_addr: no metadata store configured (NIXL_ETCD_ENDPOINTS or metadata_store); give the peer's address"
                )
            try:
                self._agent.load_by_name(_name(remote_agent))
            except KvrailError as e:
                raise _translate(e) from e
            return
        try:
            got = self._agent.load_remote_addr(f"{ip_addr}:{port}")
        except KvrailError as e:
            raise _translate(e) from e
        if remote_agent and got != remote_agent:
            logger.warning("fetched metadata of %s at %s:%d, expected %s", got, ip_addr, port, remote_agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """With a metadata store and no address: nothing to do (the agent keeps its metadata
        published there). Otherwise kvrail peers fetch it from this agent's side channel."""
        if not ip_addr and self._agent.store_up() is not None:
            return
        raise nixlNotSupportedError(
            "send_local_metadata: kvrail peers fetch metadata (fetch_remote_metadata) from the side channel"
        )

    def check_remote_metadata(self, agent: Union[str, bytes], descs=None) -> bool:
        return self._agent.has_peer(_name(agent))

    # ---- transfers ---------------------------------------------------------------------

    def prep_xfer_dlist(self, agent_name: Union[str, bytes], xfer_list, mem_type: Optional[str] = None, backends: Sequence[str] = ()) -> nixl_prepped_dlist_handle:
        """Prepare a descriptor list: local for "NIXL_INIT_AGENT" or "", else the peer's."""
        agent_name = _name(agent_name)
        local = agent_name in ("NIXL_INIT_AGENT", "")
        if not local and agent_name != self.name and not self._agent.has_peer(agent_name):
            raise nixlNotFoundError(f"unknown peer {agent_name!r}: load its metadata first")
        dl = self.get_xfer_descs(xfer_list, mem_type)
        if dl is None:
            raise nixlInvalidParamError("xfer_list: not a transfer list (see get_xfer_descs)")
        return nixl_prepped_dlist_handle(self, "" if local else agent_name, [(a, n) for a, n, _ in dl.descs])

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices,
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices,
        notif_msg: bytes = b"",
        backends: Sequence[str] = (),
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """A transfer of the chosen entries of two prepared lists."""
        _op(operation)
        for h, what in ((local_xfer_side, "local_xfer_side"), (remote_xfer_side, "remote_xfer_side")):
            if h._released:
                raise nixlInvalidParamError(f"{what}: released")
        try:
            local = [local_xfer_side._descs[int(i)] for i in local_indices]
            remote = [remote_xfer_side._descs[int(i)] for i in remote_indices]
        except IndexError:
            raise nixlInvalidParamError("indices: outside the prepared list") from None
        return self._create(operation, local, remote_xfer_side._peer, remote, notif_msg)

    def initialize_xfer(
        self,
        operation: str,
        local_descs,
        remote_descs,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: Sequence[str] = (),
    ) -> nixl_xfer_handle:
        """A transfer between two descriptor lists (``get_xfer_descs``)."""
        _op(operation)
        l = self.get_xfer_descs(local_descs)
        r = self.get_xfer_descs(remote_descs)
        if l is None or r is None:
            raise nixlInvalidParamError("descs: not transfer lists (see get_xfer_descs)")
        return self._create(
            operation, [(a, n) for a, n, _ in l.descs], _name(remote_agent), [(a, n) for a, n, _ in r.descs], notif_msg
        )

    def _create(self, op, local, peer, remote, notif_msg) -> nixl_xfer_handle:
        _op(op)
        if isinstance(notif_msg, str):
            notif_msg = notif_msg.encode()
        try:
            x = self._agent.create_xfer(op, local, peer, remote, bytes(notif_msg) or None)
        except KvrailError as e:
            raise _translate(e) from e
        self._xfers[x] = peer
        tel = nixlXferTelemetry()
        tel.descCount, tel.totalBytes = len(local), sum(n for _, n in local)
        tel.backendName = next(iter(self.backends), "UCX")
        self._telemetry[x] = tel
        return nixl_xfer_handle(self, x)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Post a transfer (again, once done); "PROC", "DONE" or "ERR"."""
        if isinstance(notif_msg, str):
            notif_msg = notif_msg.encode()
        t0 = time.time_ns()
        try:
            if notif_msg:
                self._agent.set_notif(handle._handle, bytes(notif_msg))
            self._agent.post(handle._handle)
        except MisuseError as e:
            raise _translate(e) from e
        except KvrailError as e:
            logger.error("transfer failed to post: %s", e)
            return "ERR"
        tel = self._telemetry.get(handle._handle)
        if tel is not None:
            tel.startTime = t0 // 1000
            tel.postDuration = max(1, (time.time_ns() - t0) // 1000)
            tel.xferDuration = 0
        return self.check_xfer_state(handle)

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"DONE", "PROC" or "ERR"."""
        try:
            st = self._agent.status(handle._handle)
        except KvrailError as e:
            raise _translate(e) from e
        if st == "ERR":
            logger.error("transfer 0x%x failed: %s", handle._handle, self._agent.error(handle._handle))
        elif st == "DONE":
            tel = self._telemetry.get(handle._handle)
            if tel is not None and tel.startTime and not tel.xferDuration:
                tel.xferDuration = max(tel.postDuration, time.time_ns() // 1000 - tel.startTime)
        return "PROC" if st == "NOT_POSTED" else st

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        """What the transfer did, in NIXL's fields (:class:`nixlXferTelemetry`); needs
        ``capture_telemetry`` (or ``NIXL_TELEMETRY_ENABLE=y``), else
        :class:`nixlNoTelemetryError`. ``xferDuration`` is 0 until the completion is seen by
        ``check_xfer_state``."""
        if not self._telemetry_on:
            raise nixlNoTelemetryError(
                "telemetry is off: nixl_agent_config(capture_telemetry=True) or NIXL_TELEMETRY_ENABLE=y"
            )
        tel = self._telemetry.get(handle._handle)
        if tel is None or handle._released:
            raise nixlNotFoundError(f"no transfer {handle._handle:#x} (released?)")
        if not tel.startTime:
            raise nixlNotPostedError(f"transfer {handle._handle:#x} was not posted")
        out = nixlXferTelemetry()
        for k in nixlXferTelemetry.__slots__:
            setattr(out, k, getattr(tel, k))
        return out

    def get_xfer_error(self, handle: nixl_xfer_handle) -> Optional[Exception]:
        """(kvrail) Why a transfer is in "ERR": its exception, else None."""
        return self._agent.error(handle._handle)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def _release_xfer(self, x: int) -> None:
        try:
            self._agent.release(x)
        except KvrailError as e:
            raise _translate(e) from e
        self._xfers.pop(x, None)
        self._telemetry.pop(x, None)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> Tuple[int, int, str]:
        raise nixlNotSupportedError("estimate_xfer_cost: kvrail has no cost model")

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        return next(iter(self.backends), "UCX")

    # ---- notifications -----------------------------------------------------------------

    def get_new_notifs(self, backends: Sequence[str] = ()) -> Dict[str, List[bytes]]:
        """Notifications that arrived since the last call: peer name -> list of bytes."""
        out: Dict[str, List[bytes]] = {}
        for peer, msg in self._agent.get_new_notifs():
            out.setdefault(peer, []).append(msg)
        return out

    def update_notifs(self, backends: Sequence[str] = ()) -> Dict[str, List[bytes]]:
        """Add new notifications to ``self.notifs`` and return it."""
        for peer, msgs in self.get_new_notifs().items():
            self.notifs.setdefault(peer, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: Union[str, bytes], lookup_tag: bytes, backends: Sequence[str] = (), tag_is_prefix: bool = True) -> bool:
        """Whether a notification from the peer starting with (or containing) the tag
        arrived; removes that one notification."""
        remote_agent_name = _name(remote_agent_name)
        self.update_notifs()
        msgs = self.notifs.get(remote_agent_name, [])
        for i, m in enumerate(msgs):
            if (tag_is_prefix and m.startswith(lookup_tag)) or (not tag_is_prefix and lookup_tag in m):
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: Union[str, bytes], notif_msg: bytes, backend: Optional[str] = None) -> None:
        remote_agent_name = _name(remote_agent_name)
        if isinstance(notif_msg, str):
            notif_msg = notif_msg.encode()
        try:
            self._agent.send_notif(remote_agent_name, bytes(notif_msg))
        except KvrailError as e:
            raise _translate(e) from e

    # ---- descriptor serialization ------------------------------------------------------

    def get_serialized_descs(self, descs) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes):
        return pickle.loads(serialized_descs)


__all__ = [
    "DEFAULT_COMM_PORT",
    "NIXL_INIT_AGENT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
    "nixlRegDList",
    "nixlXferDList",
    "nixlXferTelemetry",
    "nixlNotFoundError",
    "nixlInvalidParamError",
    "nixlRepostActiveError",
    "nixlNotAllowedError",
    "nixlNotPostedError",
    "nixlNoTelemetryError",
    "nixlNotSupportedError",
    "nixlBackendError",
    "nixlCancelledError",
    "nixlUnknownError",
    "nixlRemoteDisconnectError",
    "nixlMismatchError",
]
