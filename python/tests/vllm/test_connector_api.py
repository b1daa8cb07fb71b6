"""kvrail.vllm against the installed vLLM itself (no engine running): every method vLLM's
``KVConnectorBase_V1`` has that kvrail overrides takes vLLM's parameters; the KV layout
comes from the tensors vLLM's own view builder makes for every ``KVCacheLayout`` (and from
the shapes older vLLMs' backends made), block by block; and vLLM honours the layout kvrail
asks for.
"""

import inspect

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvrail import MisuseError  # noqa: E402
from kvrail._kv_layout import block_bytes_of, describe  # noqa: E402
from kvrail.vllm import KvrailConnector, KvrailPushConnector  # noqa: E402


def test_every_method_kvrail_overrides_has_vllms_parameters():
    assert not KVConnectorBase_V1.__abstractmethods__ - set(KvrailConnector.__dict__), (
        "an abstract method of vLLM's base is missing"
    )
    checked = 0
    for name, base in inspect.getmembers(KVConnectorBase_V1):
        if name.startswith("_") or isinstance(inspect.getattr_static(KVConnectorBase_V1, name), property):
            continue
        if not callable(base) or name not in KvrailConnector.__dict__:
            continue
        ours = inspect.signature(getattr(KvrailConnector, name)).parameters
        theirs = inspect.signature(base).parameters
        assert [(p.name, p.kind) for p in ours.values()] == [(p.name, p.kind) for p in theirs.values()], name
        checked += 1
    assert checked >= 20, f"only {checked} methods compared"
    # the constructor takes vLLM's (vllm_config, role, kv_cache_config)
    assert list(inspect.signature(KvrailConnector.__init__).parameters)[:4] == [
        "self",
        "vllm_config",
        "role",
        "kv_cache_config",
    ]
    assert issubclass(KvrailPushConnector, KVConnectorBase_V1)


def views(layout, spec, num_blocks=10, layers=3):
    """The per-layer views vLLM's worker makes for ``layout`` (its own builder)."""
    strides = compute_layout_strides(spec, num_blocks, layers, layout)
    size = layers * num_blocks * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    t = KVCacheTensor(
        size=size, layers=[f"model.layers.{i}.attn" for i in range(layers)], layer_stride=strides[0], block_stride=strides[1]
    )
    return raw, dict(zip(t.layers, create_kv_cache_views(raw, spec, num_blocks, layout, t)))


SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
DESCRIBED = {
    # layout: (planes, inner order, pages between a layer's blocks)
    KVCacheLayout.LBHNC: (1, "HND", 1),
    KVCacheLayout.LBNHC: (1, "NHD", 1),
    KVCacheLayout.BLHNC: (1, "HND", 3),
    KVCacheLayout.BLNHC: (1, "NHD", 3),
    KVCacheLayout.LHBNC: (2, "HND", 1),  # a plane per head
}


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda l: l.name)
def test_each_vllm_layout_becomes_the_blocks_vllm_indexes(layout):
    raw, caches = views(layout, SPEC)
    if layout not in DESCRIBED:
        with pytest.raises(MisuseError, match="not one run|outside the blocks"):
            describe(caches)
        return
    planes, inner, pages = DESCRIBED[layout]
    d, regs = describe(caches)
    assert (d["planes"], d["inner"]) == (planes, inner), d
    assert (d["block_stride"] or d["block_bytes"]) == pages * SPEC.page_size_bytes // planes
    assert d["num_blocks"] == 10 and d["block_size"] == 16
    assert len(regs) == 1, "one allocation, one registration"
    # every block of every layer: what kvrail moves is exactly the bytes of vLLM's view
    for i, (name, v) in enumerate(caches.items()):
        fill = torch.arange(v.numel(), dtype=torch.int32).to(torch.bfloat16).reshape(v.shape)
        v.copy_(fill)
        for b in range(10):
            for p in range(planes):
                addr, n = block_bytes_of(v, d, p, b)
                off = addr - raw.data_ptr()
                mine = raw[off : off + n]
                theirs = physical(v[b, p] if planes > 1 else v[b]).view(torch.int8).reshape(-1)
                assert torch.equal(mine, theirs), f"{layout.name} {name} block {b} plane {p}"


def physical(t):
    """``t``'s elements in memory order (axes by falling stride), contiguous."""
    order = sorted(range(t.dim()), key=lambda a: -t.stride(a))
    return t.permute(*order).contiguous()


def legacy(shape, permute=None, dtype=torch.float16):
    t = torch.zeros(shape, dtype=dtype)
    return t.permute(*permute) if permute else t


@pytest.mark.parametrize(
    "what, make, want",
    [
        # older vLLMs' FlashAttention: [2, B, N, H, D]; its HND variant permutes the strides
        ("flash_attn NHD", lambda: legacy((2, 10, 16, 4, 32)), (2, "NHD", 4)),
        ("flash_attn HND", lambda: legacy((2, 10, 4, 16, 32), (0, 1, 3, 2, 4)), (2, "HND", 4)),
        # FlashInfer: [B, 2, N, H, D], K and V inside a block
        ("flashinfer", lambda: legacy((10, 2, 16, 4, 32)), (1, "packed", 4)),
        # MLA: [B, N, C], no K/V axis, one latent a token
        ("mla", lambda: legacy((10, 16, 576)), (1, "HND", 1)),
    ],
)
def test_older_backends_shapes_become_their_blocks(what, make, want):
    caches = {f"l{i}": make() for i in range(2)}
    d, regs = describe(caches, {"kv_heads": 4, "block_size": 16})
    assert (d["planes"], d["inner"], d["kv_heads"]) == want, (what, d)
    t = caches["l0"]
    base = t.data_ptr()
    for b in (0, 3, 9):
        for p in range(d["planes"]):
            addr, n = block_bytes_of(t, d, p, b)
            idx = (p, b) if d["planes"] == 2 else (b,)
            view = t[idx]
            assert addr == view.data_ptr(), (what, b, p)
            assert n == view.numel() * view.element_size(), (what, b, p)
    assert all(len(r[4]) == 1 for r in regs) and base


def test_mla_from_vllms_own_views():
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    _, caches = views(KVCacheLayout.LBHNC, spec)
    d, _ = describe(caches)
    assert (d["planes"], d["kv_heads"], d["block_bytes"]) == (1, 1, spec.page_size_bytes)


def test_a_layout_kvrail_cannot_describe_fails_naming_the_layer():
    odd = {"model.layers.0.attn": torch.zeros((10, 4, 16, 32), dtype=torch.float16)[:, :, :, :16]}
    with pytest.raises(MisuseError, match=r"model\.layers\.0\.attn.*not one run"):
        describe(odd)
    mixed = {"a": torch.zeros((10, 2, 16, 32)), "b": torch.zeros((12, 2, 16, 32))}
    with pytest.raises(MisuseError, match="'b'.*differs"):
        describe(mixed)


def test_vllm_honours_the_layout_kvrail_asks_for():
    """vLLM's own resolution, with a backend that supports several layouts (the
    FlashAttention order of preference): kvrail's LBHNC wins over vLLM's first choice."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    ktc = KVTransferConfig(
        kv_connector="KvrailConnector",
        kv_connector_module_path="kvrail.vllm",
        kv_role="kv_producer",
        kv_buffer_device="cpu",
    )
    cfg = SimpleNamespace(
        kv_transfer_config=ktc,
        cache_config=SimpleNamespace(kv_cache_layout=None, get_resolved_kv_cache_layout=None),
        model_config=SimpleNamespace(use_mla=False),
    )
    assert KvrailConnector.get_required_kvcache_layout(cfg) == "LBHNC"
    got = resolve_kv_cache_layout(cfg, [["LBNHC", "LBHNC", "BLNHC"]])
    assert got == KVCacheLayout.LBHNC and cfg.cache_config.kv_cache_layout == "LBHNC"
    # MLA: no preference (one head: every layout is the same bytes)
    cfg.model_config.use_mla = True
    assert KvrailConnector.get_required_kvcache_layout(cfg) is None


def test_a_hybrid_model_reaches_kvrail_as_one_kv_cache_group():
    """Several KV-cache groups (sliding-window beside full attention, hybrid models): kvrail
    does not declare vLLM's SupportsHMA, so vLLM turns its hybrid KV-cache manager off and
    makes one group of every layer (vLLM's own grouping, below); a kv_cache_config of
    several groups, forced on, is refused when the connector is made, naming the key."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import KVCacheConfig, SlidingWindowSpec

    from kvrail import ConfigError
    from kvrail.vllm import KVConnectorRole

    ktc = KVTransferConfig(
        kv_connector="KvrailConnector",
        kv_connector_module_path="kvrail.vllm",
        kv_role="kv_consumer",
        kv_buffer_device="cpu",
    )
    assert not KVConnectorFactory.supports_hma_config(ktc), "vLLM would keep HMA on for kvrail"

    def specs():
        full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
        swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128)
        return {"model.layers.0.attn": swa, "model.layers.1.attn": full, "model.layers.2.attn": swa}

    def groups(hma_off):
        cfg = SimpleNamespace(
            scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=hma_off),
            attention_config=SimpleNamespace(hisparse_config=None),
            speculative_config=None,
            cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC),
        )
        return get_kv_cache_groups(cfg, specs())

    assert len(groups(True)) == 1, "vLLM's grouping with HMA off"
    several = groups(False)
    assert len(several) >= 2, "the same model with HMA on has groups per attention type"
    cfg = SimpleNamespace(kv_transfer_config=ktc)
    hybrid = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=several)
    with pytest.raises(ConfigError, match=r"^kv_cache_config\.kv_cache_groups: \d+ groups \(.*SlidingWindowSpec.*FullAttentionSpec"):
        KvrailConnector(cfg, KVConnectorRole.WORKER, hybrid)
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups(True))
    KvrailConnector(cfg, KVConnectorRole.WORKER, one)


def test_settings_are_read_from_the_engine_and_pipeline_parallelism_is_refused():
    """The compatibility hash covers what the engine runs (its model, dtype, an attention
    backend it was given, a draft model), read from vLLM's own config; pipeline parallelism
    (layers split over engine ranks) is refused when the connector is made, naming it."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig

    from kvrail import ConfigError
    from kvrail.vllm import KVConnectorRole

    ktc = KVTransferConfig(kv_connector="KvrailConnector", kv_connector_module_path="kvrail.vllm",
                           kv_role="kv_consumer", kv_buffer_device="cpu")

    def cfg(pp=1, backend=None, draft=None):
        return SimpleNamespace(
            kv_transfer_config=ktc,
            parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=1),
            model_config=SimpleNamespace(model="/m", dtype="bfloat16", use_mla=False),
            attention_config=SimpleNamespace(backend=backend),
            speculative_config=SimpleNamespace(model=draft) if draft else None,
        )

    with pytest.raises(ConfigError, match=r"^parallel_config\.pipeline_parallel_size: 2"):
        KvrailConnector(cfg(pp=2), KVConnectorRole.WORKER)
    c = KvrailConnector(cfg(backend=SimpleNamespace(name="CPU_ATTN"), draft="/draft"), KVConnectorRole.WORKER)
    assert {k: c._agent_cfg.get(k) for k in ("model", "dtype", "attn_backend", "draft_model")} == {
        "model": "/m", "dtype": "bfloat16", "attn_backend": "CPU_ATTN", "draft_model": "/draft"}
    plain = KvrailConnector(cfg(), KVConnectorRole.WORKER)
    assert "attn_backend" not in plain._agent_cfg and "draft_model" not in plain._agent_cfg


def test_stats_are_vllms_class_and_reach_its_prometheus_counters():
    """The stats object is vLLM's ``KVConnectorStats`` (``to_dict``, ``aggregate``,
    ``reduce``): counters add up, ``leased`` (a level) keeps the later value; the class vLLM
    asks for Prometheus metrics registers ``vllm:kvrail_*`` counters and ``observe`` adds a
    step's counts to them."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    from kvrail.vllm import KvrailConnectorStats

    a = KvrailConnector.build_kv_connector_stats({"bytes_posted": 100, "transfers": 1, "leased": 4})
    assert isinstance(a, KVConnectorStats) and isinstance(a, KvrailConnectorStats)
    a.aggregate(KvrailConnectorStats({"bytes_posted": 50, "transfers": 2, "leased": 1}))
    assert a.to_dict() == {"bytes_posted": 150, "transfers": 3, "leased": 1}
    assert a.reduce() == a.to_dict() and not a.is_empty()

    registry = CollectorRegistry()

    def mk(cls):
        return lambda **kw: cls(registry=registry, **kw)

    types = {Counter: mk(Counter), Gauge: mk(Gauge), Histogram: mk(Histogram)}
    cfg = type("VllmConfig", (), {"kv_transfer_config": None})()
    prom = KvrailConnector.build_prom_metrics(cfg, types, ["engine"], {0: ["0"]})
    prom.observe({"bytes_posted": 4096, "transfers": 2, "failed_transfers": 0, "expired_leases": 1, "leased": 3}, 0)
    prom.observe({"bytes_posted": 1024, "transfers": 1}, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvrail_bytes_posted_total{engine="0"} 5120.0' in text, text
    assert 'vllm:kvrail_transfers_total{engine="0"} 3.0' in text
    assert 'vllm:kvrail_expired_leases_total{engine="0"} 1.0' in text
    assert 'vllm:kvrail_read_backs_total{engine="0"} 0.0' in text


def test_sliding_windows_are_read_from_vllms_kv_cache_spec():
    """The windows swa_window_mode needs come from vLLM's KV-cache config: a group of
    ``SlidingWindowSpec`` layers, the ``FullAttentionSpec`` vLLM promotes them to with the
    hybrid manager off (the window kept), and per-layer specs in one group; full-attention
    layers have none."""
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    from kvrail.vllm import sliding_windows

    common = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(sliding_window=128, **common)
    promoted = FullAttentionSpec(sliding_window=256, **common)
    full = FullAttentionSpec(**common)
    groups = [
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], swa),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], promoted),
        KVCacheGroupSpec(
            ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"],
            UniformTypeKVCacheSpecs(
                block_size=16,
                kv_cache_specs={"model.layers.2.self_attn.attn": promoted, "model.layers.3.self_attn.attn": full},
            ),
        ),
    ]
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    assert sliding_windows(cfg) == {
        "model.layers.0.self_attn.attn": 128,
        "model.layers.1.self_attn.attn": 256,
        "model.layers.2.self_attn.attn": 256,
    }
