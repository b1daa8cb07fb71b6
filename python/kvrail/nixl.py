"""NIXL's Python agent API (``nixl._api``) on kvrail: a program written for NIXL runs
unchanged when its import is swapped::

    from kvrail.nixl import nixl_agent, nixl_agent_config

``nixl_agent`` is built on the bindings-level ``nixlAgent`` (:mod:`kvrail._nixl_bindings`,
looked up there when an agent is made), as NIXL's is. Descriptors are NIXL's:
``(address, length, device id[, meta])`` in memory registered with the agent, "DRAM" or
"VRAM" (NPU memory through the RBLN runtime). NIXL backend names ("UCX", …) are accepted and
mapped to kvrail's own transport choice — RDMA verbs where a usable rail exists, TCP
otherwise — with a log line. kvrail's own agent keys can be given as
``nixl_agent_config(kvrail_config={...})`` or as JSON in the ``KVRAIL_AGENT_CONFIG``
environment variable (e.g. ``{"side_channel_host": "10.0.0.5"}`` for peers on other hosts).

Metadata is exchanged as NIXL's examples do: as bytes, through a peer's listener
(``fetch_remote_metadata``/``send_local_metadata``/``invalidate_local_metadata`` with an
address), or through etcd (``NIXL_ETCD_ENDPOINTS``), whole or partial.

Errors are NIXL's exception names (``nixlNotFoundError`` for an unknown peer, …), each also a
:class:`kvrail.KvrailError` of the matching fault group.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _nixl_bindings as _bind
from ._amx import request_amx_permission
from ._kvrail import KvrailError, MisuseError
from ._nixl_bind_agent import translate as _translate
from ._nixl_types import (
    _dlist,
    _op,
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    NIXL_SUCCESS,
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
    nixlRemoteDList,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
    nixlXferDList,
    nixlXferTelemetry,
)

logger = logging.getLogger("kvrail.nixl")

# vLLM's NixlConnector runs on this module (the compat package): vLLM's CPU attention uses AMX
# tiles without asking Linux for them (see kvrail._amx)
request_amx_permission()


def _name(agent: Union[str, bytes]) -> str:
    """An agent name as NIXL passes them: str, or the bytes ``add_remote_agent`` returned."""
    return agent.decode() if isinstance(agent, (bytes, bytearray)) else str(agent)


class _Handle:
    """A handle on the bindings agent's integer one, released once (on ``release``, or when
    the object goes if the program did not release it)."""

    __slots__ = ("_agent", "_handle", "_released")
    _release_with = ""  # the nixlAgent method that releases it

    def __init__(self, agent: "nixl_agent", value: int):
        self._agent, self._handle, self._released = agent, int(value), False

    def release(self) -> None:
        if not self._released:
            getattr(self._agent.agent, self._release_with)(self._handle)
            self._released = True

    def __del__(self):
        if not getattr(self, "_released", True):
            try:
                self.release()
            except Exception:  # the agent is gone, or the transfer still active
                pass


class nixl_prepped_dlist_handle(_Handle):
    """A descriptor list prepared for ``make_prepped_xfer`` (``prep_xfer_dlist``)."""

    __slots__ = ()
    _release_with = "releasedDlistH"

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle({self._handle}, released={self._released})"


class nixl_xfer_handle(_Handle):
    """A transfer request (``initialize_xfer`` / ``make_prepped_xfer``)."""

    __slots__ = ()
    _release_with = "releaseXferReq"

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


class nixl_agent:
    """A NIXL agent on kvrail: register memory, exchange metadata, READ and WRITE
    descriptor lists with notifications. ``agent`` is its bindings-level ``nixlAgent``."""

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
        # NIXL's rule: a listening agent is thread safe by default
        default_sync = (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if conf.enable_listen else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
        bc = _bind.nixlAgentConfig(
            conf.enable_pthread,
            conf.enable_listen,
            conf.port,
            (conf.sync_mode or default_sync).value,
            captureTelemetry=conf.capture_telemetry,
        )
        bc.kvrailConfig = dict(conf.kvrail_config)
        try:
            self.agent = _bind.nixlAgent(agent_name, bc)
        except KvrailError as e:
            raise _translate(e) from e
        self.name = agent_name
        self.notifs: Dict[str, List[bytes]] = {}
        self.backends: Dict[str, int] = {}
        self.backend_mems: Dict[str, List[str]] = {}
        self.backend_options: Dict[str, Dict[str, str]] = {}
        self.plugin_list = self.agent.getAvailPlugins()
        self._owners: Dict[Any, Any] = {}  # (addr, len) -> the objects whose memory it is
        for b in self.plugin_list if instantiate_all else conf.backends:
            if b in self.plugin_list:
                self.create_backend(b, {})
            else:
                logger.warning("Skipping backend registration %s due to the missing plugin.", b)
        logger.info("Initialized kvrail agent %s (backend %s)", agent_name, self.agent.kvrail.backend)

    def _handles(self, backends: Sequence[str]) -> List[int]:
        out = []
        for b in backends:
            if b not in self.backends:
                raise nixlNotFoundError(f"backend {b!r}: not created on this agent")
            out.append(self.backends[b])
        return out

    # ---- backends ----------------------------------------------------------------------

    def get_plugin_list(self) -> List[str]:
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> List[str]:
        """The memory types behind a NIXL backend name; empty (with a warning) for a name
        kvrail does not stand in for, as in NIXL."""
        if backend not in self.plugin_list:
            logger.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return self.agent.getPluginParams(backend)[1]

    def get_plugin_params(self, backend: str) -> Dict[str, str]:
        if backend not in self.plugin_list:
            logger.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return self.agent.getPluginParams(backend)[0]

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
        h = self.agent.createBackend(backend, initParams or {})
        self.backends[backend] = h
        self.backend_options[backend], self.backend_mems[backend] = self.agent.getBackendParams(h)

    # ---- memory ------------------------------------------------------------------------

    def get_reg_descs(self, descs, mem_type: Optional[str] = None) -> Optional[nixlRegDList]:
        """A registration list from 4-tuples (with ``mem_type``), an Nx3 array, a tensor or
        array or buffer, a list of those, or a nixlRegDList."""
        return _dlist(descs, mem_type, nixlRegDList, nixlXferDList, strict=False)

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None) -> Optional[nixlXferDList]:
        """A transfer list from 3-tuples (with ``mem_type``), an Nx3 array, a tensor or array
        or buffer, a list of those, or a nixlXferDList."""
        return _dlist(descs, mem_type, nixlXferDList, nixlRegDList, strict=False)

    def get_remote_descs(self, descs, mem_type: Optional[str] = None) -> Optional[nixlRemoteDList]:
        """A list in peers' memory from ``(addr, len, dev, agent name)`` 4-tuples (with
        ``mem_type``) or a nixlRemoteDList; None (logged) otherwise, as in NIXL."""
        if isinstance(descs, nixlRemoteDList):
            return descs
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple) and len(descs[0]) == 4:
            if mem_type is None:
                logger.error("Please specify a mem type for a remote descriptor list")
                return None
            return nixlRemoteDList(mem_type, descs)
        logger.error("A remote descriptor list needs (addr, len, dev, agent name) 4-tuples")
        return None

    def register_memory(self, reg_list, mem_type: Optional[str] = None, backends: Sequence[str] = ()) -> nixlRegDList:
        """Register memory in place (kvrail never copies it on RDMA); returns the list for
        ``deregister_memory``. The objects given stay referenced until then."""
        reg = _dlist(reg_list, mem_type, nixlRegDList, nixlXferDList, strict=True)
        self.agent.registerMem(reg, self._handles(backends))
        for a, n, _, _ in reg.descs:
            self._owners[(a, n)] = reg._owners
        return reg

    def deregister_memory(self, dereg_list: nixlRegDList, backends: Sequence[str] = ()) -> None:
        """Deregister what ``register_memory`` registered (refused while a transfer uses it)."""
        self.agent.deregisterMem(dereg_list, self._handles(backends))
        for a, n, _, _ in dereg_list.descs:
            self._owners.pop((a, n), None)

    def query_memory(self, reg_list, backend: str, mem_type: Optional[str] = None) -> List[Optional[Dict[str, str]]]:
        reg = self.get_reg_descs(reg_list, mem_type)
        if reg is None:
            raise nixlInvalidParamError("reg_list: not a registration list (see get_reg_descs)")
        return self.agent.queryMem(reg, self.backends.get(backend, 0))

    # ---- metadata and peers ------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(self, descs, inc_conn_info: bool, backends: Sequence[str] = ()) -> bytes:
        """Metadata naming only the regions ``descs`` (a registration list) lie in."""
        return self.agent.getLocalPartialMD(self._reg(descs), inc_conn_info, self._handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's metadata (whole or partial) and connect; returns the peer's name as
        bytes, as NIXL does (every call takes it as bytes or str)."""
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent: Union[str, bytes]) -> None:
        """Forget a peer (its connection closes); an unknown name is ignored, as in NIXL."""
        if self.agent.invalidateRemoteMD(_name(agent)) != NIXL_SUCCESS:
            logger.warning("remove_remote_agent: no peer %r", _name(agent))

    def make_connection(self, remote_agent: Union[str, bytes], backends: Sequence[str] = ()) -> None:
        """kvrail connects when the metadata is loaded: only checks the peer is known."""
        self.agent.makeConnection(_name(remote_agent), self._handles(backends))

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Send this agent's metadata to the peer listening at ip:port (it loads it and
        connects back), or with no address publish it in the metadata store."""
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(
        self,
        descs,
        inc_conn_info: bool = False,
        backends: Sequence[str] = (),
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:
        """``get_partial_agent_metadata`` sent to the peer listening at ip:port."""
        self.agent.sendLocalPartialMD(self._reg(descs), inc_conn_info, self._handles(backends), ip_addr, port, label)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        """Load the metadata of the peer listening at ip:port, or with no address, by name
        from the metadata store (``NIXL_ETCD_ENDPOINTS`` or the ``metadata_store`` key)."""
        self.agent.fetchRemoteMD(_name(remote_agent), ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Tell the peer listening at ip:port to forget this agent, or with no address
        withdraw this agent's metadata from the metadata store."""
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: Union[str, bytes], descs=None) -> bool:
        """Whether the peer's metadata is loaded and covers ``descs`` (a transfer list in
        the peer's memory; none: the peer alone)."""
        if descs is None:
            descs = nixlXferDList("DRAM")
        elif not isinstance(descs, nixlXferDList):
            descs = self.get_xfer_descs(descs)
            if descs is None:
                raise nixlInvalidParamError("descs: not a transfer list (see get_xfer_descs)")
        return self.agent.checkRemoteMD(_name(agent), descs) == NIXL_SUCCESS

    def _reg(self, descs) -> nixlRegDList:
        reg = descs if isinstance(descs, nixlRegDList) else self.get_reg_descs(descs)
        if reg is None:
            raise nixlInvalidParamError("descs: not a registration list (see get_reg_descs)")
        return reg

    # ---- transfers ---------------------------------------------------------------------

    def prep_xfer_dlist(self, agent_name: Union[str, bytes], xfer_list, mem_type: Optional[str] = None, backends: Sequence[str] = ()) -> nixl_prepped_dlist_handle:
        """Prepare a descriptor list: local for "NIXL_INIT_AGENT" or "", else the peer's."""
        name = _name(agent_name)
        dl = self.get_xfer_descs(xfer_list, mem_type)
        if dl is None:
            raise nixlInvalidParamError("xfer_list: not a transfer list (see get_xfer_descs)")
        local = name in ("NIXL_INIT_AGENT", NIXL_INIT_AGENT)
        h = self.agent.prepXferDlist(NIXL_INIT_AGENT if local else name, dl, self._handles(backends))
        return nixl_prepped_dlist_handle(self, h)

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
            if not isinstance(h, nixl_prepped_dlist_handle) or h._released:
                raise nixlInvalidParamError(f"{what}: not a prepared list, or released")
        x = self.agent.makeXferReq(
            operation,
            local_xfer_side._handle,
            list(local_indices),
            remote_xfer_side._handle,
            list(remote_indices),
            notif_msg,
            self._handles(backends),
            skip_desc_merge,
        )
        return nixl_xfer_handle(self, x)

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
        x = self.agent.createXferReq(operation, l, r, _name(remote_agent), notif_msg, self._handles(backends))
        return nixl_xfer_handle(self, x)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Post a transfer (again, once done); "PROC", "DONE" or "ERR"."""
        try:
            st = self.agent.postXferReq(handle._handle, notif_msg)
        except MisuseError:
            raise
        except KvrailError as e:
            logger.error("transfer failed to post: %s", e)
            return "ERR"
        return "DONE" if st == NIXL_SUCCESS else "PROC"

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"DONE", "PROC" or "ERR" (the reason logged; ``get_xfer_error`` gives it)."""
        try:
            st = self.agent.getXferStatus(handle._handle)
        except MisuseError:
            raise
        except KvrailError as e:
            logger.error("transfer 0x%x failed: %s", handle._handle, e)
            return "ERR"
        return "DONE" if st == NIXL_SUCCESS else "PROC"

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        """What the transfer did, in NIXL's fields (:class:`nixlXferTelemetry`); needs
        ``capture_telemetry`` (or ``NIXL_TELEMETRY_ENABLE=y``), else
        :class:`nixlNoTelemetryError`. ``xferDuration`` is 0 until the completion is seen by
        ``check_xfer_state``."""
        return self.agent.getXferTelemetry(handle._handle)

    def get_xfer_error(self, handle: nixl_xfer_handle) -> Optional[Exception]:
        """(kvrail) Why a transfer is in "ERR": its exception, else None."""
        return self.agent.xfer_error(handle._handle)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle):
        return self.agent.estimateXferCost(req_handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        h = self.agent.queryXferBackend(handle._handle)
        return next((n for n, v in self.backends.items() if v == h), "UCX")

    def prep_mem_view(self, dlist, backends: Sequence[str] = ()) -> int:
        return self.agent.prepMemView(dlist)

    def release_mem_view(self, mvh: int) -> None:
        self.agent.releaseMemView(mvh)

    # ---- notifications -----------------------------------------------------------------

    def get_new_notifs(self, backends: Sequence[str] = ()) -> Dict[str, List[bytes]]:
        """Notifications that arrived since the last call: peer name -> list of bytes."""
        return self.agent.getNotifs({}, self._handles(backends))

    def update_notifs(self, backends: Sequence[str] = ()) -> Dict[str, List[bytes]]:
        """Add new notifications to ``self.notifs`` and return it."""
        for peer, msgs in self.get_new_notifs(backends).items():
            self.notifs.setdefault(peer, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: Union[str, bytes], lookup_tag: bytes, backends: Sequence[str] = (), tag_is_prefix: bool = True) -> bool:
        """Whether a notification from the peer starting with (or containing) the tag
        arrived; removes that one notification."""
        remote_agent_name = _name(remote_agent_name)
        self.update_notifs(backends)
        msgs = self.notifs.get(remote_agent_name, [])
        for i, m in enumerate(msgs):
            if (tag_is_prefix and m.startswith(lookup_tag)) or (not tag_is_prefix and lookup_tag in m):
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: Union[str, bytes], notif_msg: bytes, backend: Optional[str] = None) -> None:
        self.agent.genNotif(_name(remote_agent_name), notif_msg, self._handles([backend] if backend else []))

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
    "nixlRemoteDList",
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
