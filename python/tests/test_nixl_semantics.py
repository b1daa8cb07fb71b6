"""kvrail.nixl answers as NIXL does where NIXL documents or tests a behaviour (NIXL 1.5's
Python API and its test/python/test_nixl_api.py): bad input, unknown names, descriptor-list
constructors, telemetry. Each case here is one of NIXL's; where kvrail chooses to differ,
the README's NIXL section says so."""

import uuid

import numpy as np
import pytest

import kvrail
from kvrail import _nixl_bindings as bindings
from kvrail import _nixl_utils as utils
from kvrail.nixl import nixl_agent, nixl_agent_config, nixl_thread_sync_t

CFG = {"backend": "tcp", "listen": "127.0.0.1:0"}


def agent(backends=("UCX",), **kw):
    return nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=list(backends), kvrail_config=CFG, **kw))


class NonContiguous:
    """What kvrail sees of a transposed torch tensor (data_ptr, numel, element_size, not
    contiguous); the vLLM venv's test repeats the case with torch itself."""

    device = None

    def data_ptr(self):
        return 4096

    def numel(self):
        return 8

    def element_size(self):
        return 8

    def is_contiguous(self):
        return False


def test_an_empty_agent_name_is_a_value_error():
    with pytest.raises(ValueError, match="agent_name"):
        nixl_agent("", nixl_agent_config(kvrail_config=CFG))


def test_sync_mode_must_be_a_nixl_thread_sync_t():
    with pytest.raises(TypeError, match="sync_mode must be a nixl_thread_sync_t"):
        nixl_agent_config(sync_mode=1)
    for mode in [None] + list(nixl_thread_sync_t):
        assert nixl_agent_config(sync_mode=mode).sync_mode is mode
    assert nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT is nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE


def test_unknown_operations_are_key_errors_before_anything_else():
    a = agent(backends=())
    l1, l2 = bindings.nixlXferDList(bindings.DRAM_SEG), bindings.nixlXferDList(bindings.DRAM_SEG)
    with pytest.raises(KeyError):
        a.make_prepped_xfer("RD", 0, [], 0, [])
    with pytest.raises(KeyError):
        a.initialize_xfer("WR", l1, l2, "nobody")


def test_unknown_plugins_and_backends_give_empty_answers():
    a = agent()
    assert a.get_plugin_mem_types("UVX") == [] and a.get_plugin_params("UVX") == {}
    assert a.get_backend_mem_types("UVX") == [] and a.get_backend_params("UVX") == {}
    # NIXL 1.5.1 names them as its bindings do (getPluginParams: ['DRAM_SEG', 'VRAM_SEG'])
    assert a.get_plugin_mem_types("UCX") == ["DRAM_SEG", "VRAM_SEG"]
    assert a.get_backend_mem_types("UCX") == ["DRAM_SEG", "VRAM_SEG"]
    with pytest.raises(bindings.nixlNotFoundError):
        a.create_backend("UVX")
    # a config naming an unknown backend skips it with a warning, as NIXL does
    b = agent(backends=("UVX", "UCX"))
    assert list(b.backends) == ["UCX"]


def test_malformed_descriptor_lists_are_none_and_unknown_memory_types_key_errors():
    a = agent(backends=())
    reg, xfer = bindings.nixlRegDList(bindings.DRAM_SEG), bindings.nixlXferDList(bindings.DRAM_SEG)
    assert a.get_xfer_descs([(1, 2, 3, 4)]) is None  # 4-tuples for a transfer list
    assert a.get_xfer_descs([(1, 2, 3)], mem_type=None) is None  # no memory type
    assert a.get_xfer_descs(reg) is None  # a registration list
    with pytest.raises(KeyError):
        a.get_xfer_descs([(1, 2, 3)], mem_type="V-RAM")
    assert a.get_reg_descs([(1, 2, 3)]) is None
    assert a.get_reg_descs([(1, 2, 3, 4)], mem_type=None) is None
    assert a.get_reg_descs(xfer) is None
    with pytest.raises(KeyError):
        a.get_reg_descs([(1, 2, 3, 4)], mem_type="V-RAM")
    # an Nx3 array needs its memory type too
    assert a.get_xfer_descs(np.array([[1, 2, 0]], dtype=np.uint64)) is None
    assert a.get_xfer_descs(np.array([[1, 2, 0]], dtype=np.uint64), "DRAM").descCount() == 1
    # a type NIXL knows and kvrail does not move
    with pytest.raises(bindings.nixlInvalidParamError, match="mem_type"):
        a.get_xfer_descs([(1, 2, 0)], "FILE")


def test_non_contiguous_memory_gives_none_and_registering_it_says_why():
    a = agent(backends=())
    assert a.get_reg_descs(NonContiguous()) is None
    assert a.get_xfer_descs(NonContiguous()) is None
    assert a.get_xfer_descs(np.zeros((64, 64), np.uint8)[:, ::2]) is None
    with pytest.raises(kvrail.MisuseError, match="not contiguous"):
        a.register_memory(NonContiguous())


def test_descriptor_lists_are_built_from_a_segment_type():
    x = bindings.nixlXferDList(bindings.DRAM_SEG)
    assert x.descCount() == 0 and x.isEmpty() and x.getType() == bindings.DRAM_SEG
    x.append((1, 2, 0))
    assert x.descCount() == 1 and x[0] == (1, 2, 0)
    r = bindings.nixlRegDList(bindings.VRAM_SEG, [(1, 2, 3, "m")])
    assert r.getType() == bindings.VRAM_SEG and r[0] == (1, 2, 3, "m")
    assert bindings.nixlRegDList(bindings.DRAM_SEG, np.array([[1, 2, 0]], dtype=np.uint64))[0] == (1, 2, 0, "")
    with pytest.raises(KeyError):
        bindings.nixlXferDList("V-RAM")


def test_metadata_pass_with_malloc_passthru():
    a1, a2 = agent(), agent()
    addr = utils.malloc_passthru(1024)
    try:
        assert a1.register_memory(a1.get_reg_descs([(addr, 1024, 0, "test")], "DRAM")) is not None
        assert a2.add_remote_agent(a1.get_agent_metadata()) == a1.name.encode()
    finally:
        utils.free_passthru(addr)


def transfer_with_telemetry(a1, a2, size=128):
    """NIXL's telemetry check: a WRITE of two descriptors with a notification, completed.
    (The memory stays registered, and allocated, until the process ends.)"""
    import ctypes

    x, y = utils.malloc_passthru(size), utils.malloc_passthru(size)
    utils.ba_buf(x, size)
    a1.register_memory(a1.get_reg_descs([(x, size, 0, "")], "DRAM"))
    a2.register_memory(a2.get_reg_descs([(y, size, 0, "")], "DRAM"))
    a1.add_remote_agent(a2.get_agent_metadata())
    half = size // 2
    src = a1.get_xfer_descs([(x, half, 0), (x + half, half, 0)], "DRAM")
    dst = a1.get_xfer_descs([(y, half, 0), (y + half, half, 0)], "DRAM")
    h = a1.initialize_xfer("WRITE", src, dst, a2.name, b"telem_msg")
    assert a1.transfer(h) in ("DONE", "PROC")
    while a1.check_xfer_state(h) != "DONE":
        pass
    while not a2.check_remote_xfer_done(a1.name, b"telem_msg"):
        pass
    assert ctypes.string_at(y, size) == b"\xba" * size
    return h


def test_get_xfer_telemetry_reports_nixls_fields(monkeypatch):
    monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
    a1, a2 = agent(capture_telemetry=True), agent()
    h = transfer_with_telemetry(a1, a2)
    t = a1.get_xfer_telemetry(h)
    assert isinstance(t, bindings.nixlXferTelemetry)
    assert t.descCount == 2 and t.totalBytes == 128
    assert t.startTime > 0 and t.postDuration > 0 and t.xferDuration >= t.postDuration > 0
    assert t.backendName == "UCX"
    a1.release_xfer_handle(h)
    with pytest.raises(bindings.nixlNotFoundError):
        a1.get_xfer_telemetry(h)


def test_telemetry_follows_nixl_telemetry_enable_over_the_config(monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "no")
    a1, a2 = agent(capture_telemetry=True), agent()
    h = transfer_with_telemetry(a1, a2)
    with pytest.raises(bindings.nixlNoTelemetryError, match="telemetry is off"):
        a1.get_xfer_telemetry(h)
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    b1, b2 = agent(), agent()
    h = transfer_with_telemetry(b1, b2)
    assert b1.get_xfer_telemetry(h).totalBytes == 128


def test_nixl_exceptions_are_kvrail_errors_of_their_fault_group():
    assert issubclass(bindings.nixlNotFoundError, kvrail.MisuseError)
    assert issubclass(bindings.nixlNoTelemetryError, kvrail.MisuseError)
    assert issubclass(bindings.nixlRemoteDisconnectError, kvrail.PeerConnectionError)
    assert issubclass(bindings.nixlBackendError, kvrail.KvrailError)
    assert bindings.NIXL_INIT_AGENT == "" and bindings.DEFAULT_COMM_PORT == 8888
    assert int(bindings.NIXL_ERR_NOT_FOUND) == -4 and int(bindings.VRAM_SEG) == 1
