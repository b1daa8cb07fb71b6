"""A vLLM KV connector (``KVConnectorBase_V1``) on kvrail: prefill (P) and decode (D)
instances move KV-cache blocks over RDMA verbs or TCP, pull (D READs) or push (P WRITEs),
with leases P renews on D's heartbeats.

vLLM loads it by module path::

    --kv-transfer-config '{"kv_connector": "KvrailConnector",
                           "kv_connector_module_path": "kvrail.vllm",
                           "kv_role": "kv_producer", "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"kv_lease_duration": 30}}'

``kv_connector`` names the direction: ``KvrailConnector`` or ``KvrailPullConnector`` (pull),
``KvrailPushConnector`` (push). vLLM's own ``kv_transfer_config`` keys are accepted; an
unknown key raises :class:`kvrail.ConfigError` naming it. ``kv_connector_extra_config`` takes
kvrail's keys (``kv_lease_duration``, ``decoder_kv_blocks_ttl``,
``push_registration_timeout``, ``bidirectional_kv_xfer``, ``kv_recompute_threshold``,
``chunk_mode``, ``chunk_tokens``, ``swa_window_mode``,
``push_stream``, ``stripe_width``, ``link_down_exit_s``, ``enforce_handshake_compat``,
``cluster_secret``, ``insecure``, ``fence_blocks``) and
``kvrail_agent_config``: the worker agent's keys (``listen``, ``side_channel_host``,
``backend``, ``devices``, …; see :func:`kvrail.Agent`).

When ``vllm`` is importable the class subclasses vLLM's ``KVConnectorBase_V1``. Otherwise it
works against the structural protocol below, so an engine (or a test harness) drives it
without vLLM:

* ``vllm_config`` has ``kv_transfer_config`` (a dict or an object with the keys as
  attributes) and optionally ``parallel_config.tensor_parallel_size``,
  ``scheduler_config.max_num_batched_tokens``, ``cache_config.block_size`` and
  ``model_config.model``/``dtype``; a worker's TP rank is ``vllm_config.tp_rank`` (else
  vLLM's, else 0).
* a request has ``request_id``, ``num_prompt_tokens`` (or ``prompt_token_ids``) and
  ``kv_transfer_params`` (a dict or None);
* ``blocks`` in ``update_state_after_alloc`` is a list of block ids, or has
  ``get_block_ids()`` returning one list per KV-cache group (vLLM's ``KVCacheBlocks``);
* ``scheduler_output`` may have ``scheduled_new_reqs`` (``req_id``, ``block_ids``,
  ``num_computed_tokens``) and ``scheduled_cached_reqs`` (``req_ids``, ``new_block_ids``,
  ``num_computed_tokens``) — used only by ``push_stream``;
* ``connector_output`` has ``finished_sending`` and ``finished_recving`` (sets or None);
* ``kv_caches`` maps layer names to tensors (``data_ptr()``) or numpy arrays shaped
  ``[2, num_blocks, kv_heads, block_size, head_size]`` (the HND layout this connector asks
  for). Layers laid out back to back in one allocation are registered as one pooled region.
  The memory is registered in place — kvrail never copies it on RDMA.

The call order per engine step follows vLLM: scheduler ``on_new_request`` →
``get_num_new_matched_tokens`` → ``update_state_after_alloc`` → ``build_connector_meta``;
worker ``bind_connector_metadata`` → ``start_load_kv`` → (``wait_for_layer_load`` /
``save_kv_layer`` per layer) → ``wait_for_save`` → ``get_finished`` →
``clear_connector_metadata``; scheduler ``update_connector_output``, and
``request_finished`` when a request ends.
"""

from __future__ import annotations

import enum
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from . import _kvrail
from ._amx import request_amx_permission
from ._kv_layout import describe

logger = logging.getLogger("kvrail.vllm")


def _follow_vllm_logging() -> None:
    """Inside vLLM, kvrail's records (``kvrail.*``, from the Rust side too) go where vLLM's
    go, at vLLM's level (``VLLM_LOGGING_LEVEL``, INFO by default), formatted like vLLM's
    own: an operator sees a lease that expired or a grant that was refused in the engine's
    log. A ``kvrail`` logger the application configured itself is left alone."""
    root = logging.getLogger("kvrail")
    if root.level != logging.NOTSET or root.handlers:
        return
    v = logging.getLogger("vllm")
    root.setLevel(v.getEffectiveLevel())
    if v.handlers:
        for h in v.handlers:
            root.addHandler(h)
        root.propagate = False
    from ._logging import set_log_level

    set_log_level()

# vLLM's CPU attention uses AMX tiles without asking Linux for them (see kvrail._amx)
request_amx_permission()

try:  # vLLM's base classes when vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1 as _Base,
        KVConnectorHandshakeMetadata as _HandshakeBase,
        KVConnectorMetadata as _MetaBase,
        KVConnectorRole,
    )

    HAVE_VLLM = True
    _follow_vllm_logging()
except Exception:  # pragma: no cover - exercised where vLLM is absent
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """Where a connector instance runs (vLLM's enum, when vLLM is absent)."""

        SCHEDULER = 0
        WORKER = 1

    class _MetaBase:  # type: ignore[no-redef]
        """Scheduler -> worker metadata (vLLM's ``KVConnectorMetadata``)."""

    class _HandshakeBase:  # type: ignore[no-redef]
        """Worker handshake metadata (vLLM's ``KVConnectorHandshakeMetadata``)."""

    class _Base:  # type: ignore[no-redef]
        """The structural protocol of vLLM's ``KVConnectorBase_V1`` (see the module doc)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None


@dataclass
class KvrailConnectorMetadata(_MetaBase):
    """This step's instructions for the workers (kvrail's msgpack, opaque)."""

    data: bytes = b""


@dataclass
class KvrailHandshakeMetadata(_HandshakeBase):
    """A worker's side channel: where D (or P's writer) finds this TP rank."""

    tp_rank: int = 0
    agent: str = ""
    host: str = ""
    port: int = 0


try:  # vLLM's stats base class (serialized from the worker to the logger by ``to_dict``)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore
        KVConnectorStats as _StatsBase,
    )
except Exception:  # pragma: no cover - vLLM absent

    @dataclass
    class _StatsBase:  # type: ignore[no-redef]
        """vLLM's ``KVConnectorStats`` (when vLLM is absent)."""

        data: Dict[str, Any] = field(default_factory=dict)

        def to_dict(self) -> Dict[str, Any]:
            return self.data


# KvrailConnectorStats' keys that are levels (the later value stands), not counts
_STATS_LEVELS = ("leased",)


@dataclass
class KvrailConnectorStats(_StatsBase):
    """Counters since the last call (vLLM's ``KVConnectorStats``): bytes posted, receives
    done and failed, leases that expired, read-backs declined (expired) and done, push work
    dropped, malformed notifications; and the requests held under a lease (``leased``).
    vLLM logs them as "KV Transfer metrics" and ``/metrics`` shows the counters
    (:class:`KvrailPromMetrics`)."""

    data: Dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: "KvrailConnectorStats") -> "KvrailConnectorStats":
        """Counters add up; ``leased`` (a level, not a count) takes the later value."""
        for k, v in other.data.items():
            self.data[k] = v if k in _STATS_LEVELS else self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, Any]:
        return dict(self.data)


try:  # vLLM's per-connector Prometheus metrics
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore
        KVConnectorPromMetrics as _PromBase,
    )
    from vllm.v1.metrics.utils import create_metric_per_engine as _per_engine  # type: ignore
except Exception:  # pragma: no cover - vLLM absent
    _PromBase = None

# KvrailConnectorStats' counters on /metrics: (stats key, metric name, what it counts)
_PROM_COUNTERS = (
    ("bytes_posted", "vllm:kvrail_bytes_posted", "Bytes of the KV transfers kvrail's workers posted."),
    ("transfers", "vllm:kvrail_transfers", "KV receives whose every byte arrived."),
    ("failed_transfers", "vllm:kvrail_failed_transfers", "KV receives that failed (the engine recomputes or fails the request)."),
    ("expired_leases", "vllm:kvrail_expired_leases", "Leases that ran out before the peer took the blocks (no completion or heartbeat in time)."),
    ("expired_reads", "vllm:kvrail_expired_reads", "Read-backs declined: the keeper's blocks expire before the READ would end."),
    ("read_backs", "vllm:kvrail_read_backs", "Read-backs done: a previous turn's KV reused (bidirectional_kv_xfer)."),
    ("push_dropped", "vllm:kvrail_push_dropped", "Push registrations or WRITEs dropped."),
    ("malformed", "vllm:kvrail_malformed_notifications", "Notifications dropped as malformed."),
)

if _PromBase is not None:

    class KvrailPromMetrics(_PromBase):  # type: ignore[misc, valid-type]
        """kvrail's counters for vLLM's Prometheus endpoint, per engine."""

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters = {}
            for key, name, doc in _PROM_COUNTERS:
                c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                self._counters[key] = _per_engine(c, self.per_engine_labelvalues)

        def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
            for key, per_engine in self._counters.items():
                v = transfer_stats_data.get(key, 0) or 0
                if v > 0:
                    per_engine[engine_idx].inc(v)


# vLLM's own kv_transfer_config keys (accepted, passed on; kvrail reads what it needs)
_VLLM_KEYS = (
    "kv_connector",
    "engine_id",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_role",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "kv_load_failure_policy",
    "enable_permute_local_kv",
)


def _config_dict(kv_transfer_config: Any) -> Dict[str, Any]:
    """``kv_transfer_config`` as a dict: a dict as is, else the attributes vLLM sets."""
    if kv_transfer_config is None:
        raise _kvrail.ConfigError("kv_transfer_config: required by a KV connector")
    if isinstance(kv_transfer_config, dict):
        d = dict(kv_transfer_config)
    else:
        d = {k: getattr(kv_transfer_config, k) for k in _VLLM_KEYS if getattr(kv_transfer_config, k, None) is not None}
    return {k: v for k, v in d.items() if v is not None}


def _attr(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return default
    return obj


def _prompt_tokens(request: Any) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    if n is None:
        n = len(getattr(request, "prompt_token_ids", None) or [])
    return int(n)


_REFUSED: Dict[str, None] = {}  # requests whose kv_transfer_params were said to be unusable


def _params(request: Any) -> Optional[str]:
    """The request's ``kv_transfer_params`` as JSON; None when it has none, or when they are
    not what a connector can read (a key of the wrong type, not JSON): the request is then
    served as a plain one, never loaded from or into other bytes, and the engine's log names
    the key and its value once. One client's request never stops the engine."""
    p = getattr(request, "kv_transfer_params", None)
    if not p:
        return None
    try:
        j = json.dumps(p)
        _kvrail.check_kv_transfer_params(j)
        return j
    except (TypeError, ValueError, _kvrail.MisuseError) as e:
        rid = str(getattr(request, "request_id", ""))
        if rid not in _REFUSED:
            _REFUSED[rid] = None
            while len(_REFUSED) > _LANDED_KEPT:
                _REFUSED.pop(next(iter(_REFUSED)))
            logger.error("request %s: %s; served without the KV connector", rid, e)
        return None


def _block_list(blocks: Any) -> List[int]:
    if blocks is None:
        return []
    if hasattr(blocks, "get_block_ids"):
        groups = blocks.get_block_ids()
        return [int(b) for b in (groups[0] if groups else [])]
    if blocks and isinstance(blocks, tuple) and isinstance(blocks[0], (list, tuple)):
        return [int(b) for b in blocks[0]]
    return [int(b) for b in blocks]


def _unhashed(blocks: Any) -> List[int]:
    """The blocks of ``blocks`` that no prefix-cache hit gave (vLLM's
    ``get_unhashed_block_ids``): where loaded KV may be written."""
    for name in ("get_unhashed_block_ids_all_groups", "get_unhashed_block_ids"):
        f = getattr(blocks, name, None)
        if f is not None:
            got = f()
            if got and isinstance(got[0], (list, tuple)):
                got = got[0]
            return [int(b) for b in got]
    return _block_list(blocks)


class KvrailConnector(_Base):
    """kvrail's KV connector for vLLM (both roles; see the module doc)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        self._vllm_config = vllm_config
        cfg = _config_dict(getattr(vllm_config, "kv_transfer_config", None))
        cfg.setdefault("kv_connector", type(self).__name__)
        extra = dict(cfg.get("kv_connector_extra_config") or {})
        step = _attr(vllm_config, "scheduler_config.max_num_batched_tokens")
        if step and "max_num_batched_tokens" not in extra:
            extra["max_num_batched_tokens"] = int(step)
        cfg["kv_connector_extra_config"] = extra
        self._cfg_json = json.dumps(cfg)
        # parsed now: a bad key fails the engine's start, naming the key
        _kvrail.Scheduler(self._cfg_json, "check", "127.0.0.1:1", 1)
        self._agent_cfg: Dict[str, Any] = dict(extra.get("kvrail_agent_config") or {})
        if HAVE_VLLM:
            super().__init__(vllm_config, role, kv_cache_config)
        else:
            _Base.__init__(self, vllm_config, role, kv_cache_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            kinds = ", ".join(type(getattr(g, "kv_cache_spec", g)).__name__ for g in groups)
            raise _kvrail.ConfigError(
                f"kv_cache_config.kv_cache_groups: {len(groups)} groups ({kinds}); kvrail moves one "
                "KV-cache group: vLLM turns its hybrid KV-cache manager off for a connector that does "
                "not declare SupportsHMA, unless --no-disable-hybrid-kv-cache-manager asks for it"
            )
        pp = int(_attr(vllm_config, "parallel_config.pipeline_parallel_size", 1) or 1)
        if pp > 1:
            raise _kvrail.ConfigError(
                f"parallel_config.pipeline_parallel_size: {pp}; kvrail moves the KV of every layer "
                "from one engine rank per TP rank (pipeline parallelism splits the layers: not supported)"
            )
        # what the compatibility hash covers, as this engine runs: P and D must agree on it
        compat = {
            "model": _attr(vllm_config, "model_config.model"),
            "dtype": _attr(vllm_config, "model_config.dtype"),
            "attn_backend": _attr(vllm_config, "attention_config.backend"),
            "draft_model": _attr(vllm_config, "speculative_config.model"),
        }
        for key, value in compat.items():
            if value is not None and str(value) not in ("", "None"):
                self._agent_cfg.setdefault(key, getattr(value, "name", None) or str(value))
        self._engine_id = str(cfg.get("engine_id") or os.environ.get("KVRAIL_ENGINE_ID") or "kvrail-engine")
        self._tp_size = int(_attr(vllm_config, "parallel_config.tensor_parallel_size", 1) or 1)
        self._role_name = getattr(role, "name", str(role))
        self._sched: Optional[_kvrail.Scheduler] = None
        self._worker: Optional[_kvrail.Worker] = None
        self._reqs: Dict[str, Tuple[int, Optional[str], List[int], int]] = {}
        self._recv_blocks: Dict[str, List[int]] = {}
        self._load_errors: Set[int] = set()
        self._landed: Dict[str, List[int]] = {}
        self._stats_prev: Dict[str, int] = {}
        self._transfers = (0, 0)  # receives done, failed
        self._tp_rank = int(getattr(vllm_config, "tp_rank", -1))
        if self._tp_rank < 0:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore

                self._tp_rank = int(get_tensor_model_parallel_rank())
            except Exception:
                self._tp_rank = 0
        logger.info("kvrail connector %s (%s) for engine %s", type(self).__name__, self._role_name, self._engine_id)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        """The layout kvrail asks vLLM for: each layer's blocks dense and back to back, a
        block's bytes ``[head][token][K and V]`` — LBHNC in vLLM 0.32's names (HND before),
        so a block is one descriptor and a share of its heads (another TP size) is one run.
        None for MLA, where no layout matters (one head). vLLM falls back, with a warning,
        when its backend cannot do it; kvrail then moves whatever layout it got."""
        if _attr(vllm_config, "model_config.use_mla"):
            return None
        return _LAYOUT_NAME

    # ==== scheduler side ================================================================

    def set_xfer_handshake_metadata(self, metadata: Dict[int, KvrailHandshakeMetadata]) -> None:
        """The workers' side channels: rank 0's goes to D in the transfer parameters, every
        rank's port for TP above 1."""
        if not metadata:
            return
        r0 = metadata.get(0) or metadata[min(metadata)]
        self._sched = _kvrail.Scheduler(self._cfg_json, self._engine_id, f"{r0.host}:{r0.port}", self._tp_size)
        if len(metadata) > 1:
            self._sched.set_rank_ports([int(metadata[k].port) for k in sorted(metadata)])

    def _scheduler(self) -> Optional[_kvrail.Scheduler]:
        if self._sched is None:
            addr = os.environ.get("KVRAIL_SIDE_CHANNEL")
            if addr:
                self._sched = _kvrail.Scheduler(self._cfg_json, self._engine_id, addr, self._tp_size)
        return self._sched

    def on_new_request(self, request: Any) -> None:
        """A request entered the scheduler: a remote prefill's heartbeats start now."""
        s = self._scheduler()
        rid, n, p = request.request_id, _prompt_tokens(request), _params(request)
        self._reqs[rid] = (n, p, [], 0)
        if s is not None:
            s.on_new_request(rid, n, p)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """(tokens to load from P beyond ``num_computed_tokens``, asynchronously). None until
        the workers' side channels are known (vLLM asks again later)."""
        s = self._scheduler()
        if s is None:
            return (None, False) if _params(request) else (0, False)
        n, a = s.get_num_new_matched_tokens(request.request_id, _prompt_tokens(request), _params(request), int(num_computed_tokens))
        return int(n), bool(a) and n > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        s = self._scheduler()
        rid, n, p = request.request_id, _prompt_tokens(request), _params(request)
        ids = _block_list(blocks)
        if num_external_tokens and ids:
            self._landed[rid] = ids
            while len(self._landed) > _LANDED_KEPT:
                self._landed.pop(next(iter(self._landed)))
        old = self._reqs.get(rid, (n, p, [], 0))
        self._reqs[rid] = (n, p, old[2] + [b for b in ids if b not in old[2]], old[3])
        if s is not None:
            # KV lands only in the blocks this request newly holds: a prefix D has cached
            # (vLLM's prefix caching) is the start of the prompt, shared with other requests,
            # and is never written; the lists are aligned at their ends
            into = _unhashed(blocks) if num_external_tokens else ids
            s.update_state_after_alloc(rid, n, p, into, int(num_external_tokens))
        params = getattr(request, "kv_transfer_params", None)
        if num_external_tokens and isinstance(params, dict) and params.get("do_remote_prefill"):
            # loaded from P once: vLLM asks again only to recompute after that load failed
            # (kv_load_failure_policy recompute), and the request then prefills here
            params["do_remote_prefill"] = False
        if isinstance(params, dict) and params.get("do_remote_decode") and params.get("remote_block_ids"):
            # a read-back (bidirectional_kv_xfer) is tried once, as NixlConnector marks it
            params["_remote_blocks_processed"] = True

    def received_block_ids(self, request_id: str) -> List[int]:
        """(kvrail, D) The blocks a remote-prefill request's KV was loaded into (of the last
        4096 such requests; empty for others): where to look for what D attends to.
        ``request_id`` is the engine's (vLLM's, with its random suffix) or the one the caller
        gave (``RequestOutput.request_id``)."""
        if request_id in self._landed:
            return list(self._landed[request_id])
        for rid in reversed(list(self._landed)):
            base, _, suffix = rid.rpartition("-")
            if base == request_id and len(suffix) == 8:
                return list(self._landed[rid])
        return []

    def build_connector_meta(self, scheduler_output: Any = None) -> KvrailConnectorMetadata:
        s = self._scheduler()
        if s is None:
            return KvrailConnectorMetadata(b"")
        self._stream_progress(s, scheduler_output)
        return KvrailConnectorMetadata(bytes(s.build_connector_meta()))

    def _stream_progress(self, s: _kvrail.Scheduler, out: Any) -> None:
        """push_stream: the prompt tokens whose KV earlier steps computed (best effort from
        vLLM's scheduler output)."""
        if out is None:
            return
        for r in getattr(out, "scheduled_new_reqs", None) or []:
            self._progress(s, r.req_id, _block_list(getattr(r, "block_ids", None)), int(getattr(r, "num_computed_tokens", 0)))
        c = getattr(out, "scheduled_cached_reqs", None)
        if c is not None:
            for i, rid in enumerate(getattr(c, "req_ids", []) or []):
                new = getattr(c, "new_block_ids", None)
                ids = _block_list(new[i]) if new and new[i] is not None else []
                self._progress(s, rid, ids, int(c.num_computed_tokens[i]))

    def _progress(self, s: _kvrail.Scheduler, rid: str, new_ids: List[int], computed: int) -> None:
        if rid not in self._reqs:
            return
        n, p, ids, _ = self._reqs[rid]
        ids = ids + [b for b in new_ids if b not in ids]
        self._reqs[rid] = (n, p, ids, computed)
        if computed > 0:
            s.prefill_progress(rid, n, p, ids, computed)

    def prefill_progress(self, request: Any, block_ids: Sequence[int], computed_tokens: int) -> None:
        """(kvrail) P with push_stream: ``computed_tokens`` of the prompt are in the cache."""
        s = self._scheduler()
        if s is not None:
            s.prefill_progress(request.request_id, _prompt_tokens(request), _params(request), [int(b) for b in block_ids], int(computed_tokens))

    def update_connector_output(self, connector_output: Any) -> None:
        s = self._scheduler()
        if s is None:
            return
        sending = sorted(getattr(connector_output, "finished_sending", None) or [])
        recving = sorted(getattr(connector_output, "finished_recving", None) or [])
        s.update_connector_output(list(sending), list(recving), [])

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """P: the blocks stay allocated (True) under a lease until D has them; the returned
        parameters go to D through the proxy. D with ``bidirectional_kv_xfer``: a decode
        leg that ran to its end (stopped or at its length) keeps its blocks for
        ``decoder_kv_blocks_ttl``; the returned parameters, sent to P with the next turn,
        read that KV back."""
        self._reqs.pop(request.request_id, None)
        s = self._scheduler()
        if s is None:
            return False, None
        status = getattr(getattr(request, "status", None), "name", "")
        completed = status in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
        computed = int(getattr(request, "num_computed_tokens", 0) or 0)
        delay, p = s.request_finished(
            request.request_id, _prompt_tokens(request), _params(request), [int(b) for b in block_ids], completed, computed
        )
        return bool(delay), (json.loads(p) if p else None)

    def request_finished_all_groups(self, request: Any, block_ids: Tuple[List[int], ...]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """The hybrid allocator's form: every group's blocks; kvrail's layers share the first
        group's block ids."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def has_pending_push_work(self) -> bool:
        s = self._scheduler()
        return bool(s is not None and s.has_pending_push_work())

    def take_events(self) -> Iterable[Any]:
        return ()

    def get_finished_count(self) -> Optional[int]:
        return None

    # ==== worker side ===================================================================

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        """The engine's own KV caches, registered in place (no copy). The layout comes from
        the tensors vLLM made (their shapes and strides: see :mod:`kvrail._kv_layout`);
        layers of one allocation become one pooled registration."""
        hints = {}
        heads = _kv_heads_per_rank(self._vllm_config)
        if heads:
            hints["kv_heads"] = heads
        bs = _attr(self._vllm_config, "cache_config.block_size")
        if bs:
            hints["block_size"] = int(bs)
        layout, caches = describe(kv_caches, hints, _tokens_in_order())
        windows = sliding_windows(self._kv_cache_config)
        if windows:
            # swa_window_mode moves only what these layers' windows cover
            layout["sliding_windows"] = {n: w for n, w in windows.items() if n in kv_caches}
        logical = _attr(self._kv_cache_config, "num_blocks")
        if logical and layout["num_blocks"] % int(logical) == 0 and layout["num_blocks"] > int(logical):
            # kernel blocks subdivide the scheduler's: its block l is ours l*r .. l*r + r
            layout["physical_per_logical"] = layout["num_blocks"] // int(logical)
        self._layout = layout
        self._kv_caches = dict(kv_caches)  # the engine's tensors stay referenced while registered
        agent = dict(self._agent_cfg)
        agent.setdefault("listen", "0.0.0.0:0")
        self._worker = _kvrail.Worker(
            self._engine_id, json.dumps(agent), self._cfg_json, json.dumps(layout), self._tp_rank, self._tp_size, caches
        )
        logger.info(
            "kvrail worker %s: %d layers in %d registrations on %s; %d blocks of %d bytes, "
            "%d apart, %d plane(s), %s, %d tokens, %d heads",
            self._worker.name, len(kv_caches), len(caches), self._worker.backend, layout["num_blocks"],
            layout["block_bytes"], layout["block_stride"] or layout["block_bytes"], layout["planes"],
            layout["inner"], layout["block_size"], layout["kv_heads"],
        )

    def get_handshake_metadata(self) -> Optional[KvrailHandshakeMetadata]:
        if self._worker is None:
            return None
        host, port = self._worker.side_channel_addr.rsplit(":", 1)
        if host in ("0.0.0.0", "::"):
            host = str(self._agent_cfg.get("side_channel_host", "127.0.0.1"))
        return KvrailHandshakeMetadata(self._tp_rank, self._worker.name, host, int(port))

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if meta.data:
            for rid, ids in self._worker.start_load_kv(meta.data):
                self._recv_blocks[rid] = [int(b) for b in ids]

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: Optional[Set[str]] = None) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """(requests P finished sending, requests D finished receiving — failed ones too,
        whose blocks ``get_block_ids_with_load_errors`` then names)."""
        if self._worker is None:
            return None, None
        sending, recving, failed = self._worker.get_finished()
        for rid in failed:
            self._load_errors.update(self._recv_blocks.get(rid, []))
            logger.warning("kvrail: request %s failed to load its KV", rid)
        for rid in list(recving) + list(failed):
            self._recv_blocks.pop(rid, None)
        done = set(recving) | set(failed)
        self._transfers = (self._transfers[0] + len(recving), self._transfers[1] + len(failed))
        return (set(sending) or None), (done or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        e, self._load_errors = self._load_errors, set()
        return e

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any) -> Any:
        """kvrail's counters on ``vllm serve``'s ``/metrics`` (``vllm:kvrail_*``), as
        NixlConnector's ``vllm:nixl_*``."""
        if _PromBase is None:
            return None
        return KvrailPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> Optional[KvrailConnectorStats]:
        """The stats object for ``data`` (what workers' ``to_dict`` sent the logger)."""
        return KvrailConnectorStats(dict(data or {}))

    def get_kv_connector_stats(self) -> Optional[KvrailConnectorStats]:
        if self._worker is None:
            return None
        now = {
            "bytes_posted": self._worker.bytes_posted(),
            "transfers": self._transfers[0],
            "failed_transfers": self._transfers[1],
            "expired_leases": self._worker.leases_expired(),
            "expired_reads": self._worker.expired_reads(),
            "read_backs": self._worker.read_backs(),
            "push_dropped": self._worker.push_dropped(),
            "malformed": self._worker.malformed(),
        }
        delta = {k: v - self._stats_prev.get(k, 0) for k, v in now.items()}
        self._stats_prev = now
        delta["leased"] = self._worker.leased()
        return KvrailConnectorStats(delta)

    def shutdown(self) -> None:
        self._worker = None
        self._kv_caches = {}


def sliding_windows(kv_cache_config: Any) -> Dict[str, int]:
    """Each sliding-window layer's window (tokens), from vLLM's KV-cache spec: a group's
    ``SlidingWindowSpec``, or the ``FullAttentionSpec`` vLLM promotes it to when the hybrid
    KV-cache manager is off (its ``sliding_window`` kept), per layer where a group holds
    several specs (``UniformTypeKVCacheSpecs``)."""
    out: Dict[str, int] = {}
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = getattr(g, "kv_cache_spec", None)
        per_layer = getattr(spec, "kv_cache_specs", None)
        for name in getattr(g, "layer_names", None) or []:
            s = per_layer.get(name, spec) if isinstance(per_layer, dict) else spec
            w = getattr(s, "sliding_window", None)
            if isinstance(w, int) and w > 0:
                out[name] = w
    return out


# D: requests whose loaded blocks ``received_block_ids`` remembers
_LANDED_KEPT = 4096


def _tokens_in_order() -> bool:
    """Whether the attention kernels keep a block's tokens where its logical view says:
    not vLLM's CPU backend, which views its ``[B, H, N, C]`` block as ``[H, 2N, C/2]`` (a
    head's keys, then its values: ``cpu_attn.py``'s ``do_kv_cache_update``) and writes them
    through its ISA's kernels."""
    try:
        from vllm.platforms import current_platform  # type: ignore

        return not current_platform.is_cpu()
    except Exception:
        return True


def _kv_heads_per_rank(vllm_config: Any) -> Optional[int]:
    """KV heads a TP rank holds, when vLLM's config says (a hint for legacy shapes)."""
    mc = getattr(vllm_config, "model_config", None)
    pc = getattr(vllm_config, "parallel_config", None)
    try:
        return int(mc.get_num_kv_heads(pc))  # type: ignore[union-attr]
    except Exception:
        return None


try:  # vLLM 0.32 names layouts by their axis order; earlier ones HND / NHD
    from vllm.v1.kv_cache_layout import KVCacheLayout as _VllmLayouts  # type: ignore

    _LAYOUT_NAME = _VllmLayouts.LBHNC.name
except Exception:  # pragma: no cover - vLLM absent or older
    _LAYOUT_NAME = "HND"


class KvrailPullConnector(KvrailConnector):
    """Pull: D READs P's blocks (``kv_connector: KvrailPullConnector``)."""


class KvrailPushConnector(KvrailConnector):
    """Push: P WRITEs into D's registered blocks (``kv_connector: KvrailPushConnector``)."""


__all__ = [
    "HAVE_VLLM",
    "KVConnectorRole",
    "KvrailConnector",
    "KvrailConnectorMetadata",
    "KvrailConnectorStats",
    "KvrailHandshakeMetadata",
    "KvrailPullConnector",
    "KvrailPushConnector",
]
