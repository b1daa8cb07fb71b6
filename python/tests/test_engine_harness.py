"""kvrail.vllm driven like vLLM: the engine harness (P and D in separate processes) in pull,
push and push_stream, host and NPU memory, every attended KV byte checked on D; a D killed
mid-request lets P reclaim by lease; the fake model agrees with kvrail-demo's byte for byte;
bad configuration keys raise naming the key."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import kvrail
from kvrail.vllm import KVConnectorRole, KvrailConnector, KvrailPushConnector

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import engine_harness  # noqa: E402


def harness(*args, lease=None):
    env = dict(os.environ, KVRAIL_AGENT_CONFIG=os.environ.get("KVRAIL_AGENT_CONFIG", '{"backend": "tcp"}'))
    cmd = [sys.executable, os.path.join(HERE, "engine_harness.py"), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    print(out)
    assert r.returncode == 0, out
    return out


@pytest.mark.parametrize("mode,memory", [("pull", "host"), ("push", "host"), ("push_stream", "npu"), ("pull", "npu")])
def test_requests_arrive_byte_exact(mode, memory):
    out = harness("--mode", mode, "--memory", memory, "--requests", "5")
    assert f"harness {mode}: 5 of 5 requests byte-exact; blocks leaked 0" in out
    if mode == "push_stream":
        # D registered while P prefilled: blocks went as prefill steps closed them
        assert "bytes went to D before their prompts ended" in out


def test_a_killed_decode_lets_prefill_reclaim_by_lease():
    out = harness("--mode", "pull", "--kill-d", "--lease", "2")
    assert "P freed its blocks by lease" in out and "P holds no blocks: True" in out


def _demo():
    for p in ("debug", "release"):
        b = os.path.join(ROOT, "target", p, "kvrail-demo")
        if os.path.exists(b):
            return b
    subprocess.run(["cargo", "build", "-q", "-p", "kvrail-tools", "--bin", "kvrail-demo"], cwd=ROOT, check=True)
    return os.path.join(ROOT, "target", "debug", "kvrail-demo")


def test_the_fake_model_is_kvrail_demos_byte_for_byte(tmp_path):
    demo = _demo()
    for seed, n in [(1, 20), (7, 40), (123456789, 333)]:
        out = tmp_path / f"kv-{seed}.bin"
        subprocess.run([demo, "--layers", str(engine_harness.LAYERS), "--block-size", str(engine_harness.BLOCK_SIZE),
                        "fake-kv", "--seed", str(seed), "--tokens", str(n), "--out", str(out)], check=True)
        rust = out.read_bytes()
        py = engine_harness.prompt_kv_bytes(seed, n)
        assert len(rust) == len(py) > 0
        assert rust == py, f"seed {seed}, {n} tokens: Python's model differs from kvrail-demo's"


def vllm_config(extra=None, **top):
    cfg = {"kv_connector": "KvrailConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
           "kv_connector_module_path": "kvrail.vllm", "kv_port": 14579, "kv_rank": 0, "engine_id": "e",
           "kv_connector_extra_config": extra or {}, **top}
    return SimpleNamespace(kv_transfer_config=cfg, tp_rank=0)


def test_config_keys_vllm_accepted_unknown_named():
    KvrailConnector(vllm_config(), KVConnectorRole.SCHEDULER)  # vLLM's own keys are accepted
    with pytest.raises(kvrail.ConfigError, match=r"^kv_connector_extra_config\.kv_lease:"):
        KvrailConnector(vllm_config({"kv_lease": 3}), KVConnectorRole.SCHEDULER)
    with pytest.raises(kvrail.ConfigError, match=r"^kv_buffer_size_gb:"):
        KvrailConnector(vllm_config(kv_buffer_size_gb=1), KVConnectorRole.SCHEDULER)
    with pytest.raises(kvrail.ConfigError, match=r"kvrail_agent_config"):
        KvrailConnector(vllm_config({"kvrail_agent_config": 5}), KVConnectorRole.SCHEDULER)
    w = KvrailConnector(vllm_config({"kvrail_agent_config": {"bakend": "tcp"}}), KVConnectorRole.WORKER)
    import numpy as np
    with pytest.raises(kvrail.ConfigError, match=r"^bakend:"):
        w.register_kv_caches({"l0": np.zeros((2, 4, 1, 16, 8), np.uint16)})


def test_scheduler_protocol_answers():
    s = KvrailPushConnector(vllm_config(kv_connector="KvrailPushConnector", kv_role="kv_consumer"), KVConnectorRole.SCHEDULER)
    req = SimpleNamespace(request_id="r", num_prompt_tokens=40,
                          kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
                                              "remote_port": 1, "remote_block_ids": [1, 2, 3], "remote_request_id": "pr",
                                              "tp_size": 1})
    # the workers' side channels are not known yet: "ask again later"
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    s.set_xfer_handshake_metadata({0: SimpleNamespace(host="127.0.0.1", port=5555)})
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 8) == (32, True)
    assert not s.has_pending_push_work()
    s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([4, 5, 6],)), 32)
    assert s.has_pending_push_work(), "D waits for its registration"
    assert KvrailConnector.get_required_kvcache_layout(None) == "HND"


def test_transfer_params_it_cannot_use_load_nothing_and_never_raise(caplog):
    """A client's kv_transfer_params with a key missing or of the wrong type: the scheduler
    loads nothing for that request (vLLM computes it), names the key and value in the log,
    and never raises into the engine's scheduler loop."""
    s = KvrailConnector(vllm_config(kv_role="kv_consumer"), KVConnectorRole.SCHEDULER)
    s.set_xfer_handshake_metadata({0: SimpleNamespace(host="127.0.0.1", port=5555)})
    whole = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1", "remote_port": 1,
             "remote_block_ids": [1, 2, 3], "remote_request_id": "pr", "tp_size": 1}
    ok = SimpleNamespace(request_id="ok", num_prompt_tokens=40, kv_transfer_params=dict(whole))
    s.on_new_request(ok)
    assert s.get_num_new_matched_tokens(ok, 0) == (40, True)
    for i, (key, value, said) in enumerate((("remote_host", None, 'kv_transfer_params.remote_host is ""'),
                                            ("remote_port", "1", 'remote_port: "1" is not a port'),
                                            ("remote_block_ids", [1, "x"], "remote_block_ids: [1,\"x\"] is not"),
                                            ("remote_engine_id", object(), "is not JSON serializable"))):
        kp = dict(whole)
        if value is None:
            del kp[key]
        else:
            kp[key] = value
        r = SimpleNamespace(request_id=f"bad{i}", num_prompt_tokens=40, kv_transfer_params=kp)
        caplog.clear()
        s.on_new_request(r)
        assert s.get_num_new_matched_tokens(r, 0) == (0, False), key
        s.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([4, 5, 6],)), 0)
        assert s.request_finished(r, [4, 5, 6]) == (False, None), key
        # (the Rust side's records reach Python's logging through the log bridge's thread)
        deadline = time.monotonic() + 5
        while said not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert said in caplog.text, (key, caplog.text)
