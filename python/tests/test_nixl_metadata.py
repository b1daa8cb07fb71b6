"""Metadata exchange as NIXL's examples do it, on kvrail.nixl: sent to a peer's listener
(``send_local_metadata``/``invalidate_local_metadata`` with an address), partial metadata
(``get/send_partial_agent_metadata``), ``check_remote_metadata`` with descriptors, and the
same through a real etcd (Debian's, started here) with labels. Every byte moved is checked,
and each wrong use fails with NIXL's exception type, bounded."""

import ctypes
import shutil
import socket
import subprocess
import time
import uuid

import pytest

from kvrail import _nixl_bindings as bindings
from kvrail import _nixl_utils as utils
from kvrail.nixl import nixl_agent, nixl_agent_config

CFG = {"backend": "tcp"}
SIZE = 4096


def agent(name=None, listen=True, cfg=None):
    """An agent whose listener (kvrail's side channel) is on a free loopback port."""
    conf = nixl_agent_config(True, listen, 0, kvrail_config=dict(CFG, listen="127.0.0.1:0", **(cfg or {})))
    a = nixl_agent(name or f"a-{uuid.uuid4().hex[:8]}", conf)
    return a, int(a.agent.kvrail.side_channel_addr.rsplit(":", 1)[1])


def buffers(a, n, fill):
    """``n`` malloc'd buffers of SIZE bytes filled with ``fill`` + index, registered with
    ``a`` one by one (n regions); their registration list."""
    addrs = [utils.malloc_passthru(SIZE) for _ in range(n)]
    for i, x in enumerate(addrs):
        ctypes.memset(x, (fill + i) % 256, SIZE)
    reg = a.get_reg_descs([(x, SIZE, 0, "") for x in addrs], "DRAM")
    a.register_memory(reg)
    return reg


def read_all(a, peer, local, remote, tag):
    h = a.initialize_xfer("READ", local.trim(), remote.trim(), peer, tag)
    assert a.transfer(h) != "ERR"
    deadline = time.time() + 10
    while (st := a.check_xfer_state(h)) == "PROC":
        assert time.time() < deadline, "READ did not finish in 10 s"
    assert st == "DONE"
    for (x, n, _, _), (y, _, _, _) in zip(local.descs, remote.descs):
        assert ctypes.string_at(x, n) == ctypes.string_at(y, n)
    a.release_xfer_handle(h)


def test_send_local_metadata_to_a_listener_then_read_and_invalidate():
    target, tport = agent("target")
    init, _ = agent("initiator")
    t_reg, i_reg = buffers(target, 2, 0x10), buffers(init, 2, 0x80)
    # NIXL's basic example: the initiator fetches the target's metadata and sends its own
    init.fetch_remote_metadata("target", "127.0.0.1", tport)
    init.send_local_metadata("127.0.0.1", tport)
    assert target.check_remote_metadata("initiator")  # sent, loaded, connected back
    target.send_notif("initiator", b"from target")
    deadline = time.time() + 5
    while not init.check_remote_xfer_done("target", b"from target"):
        assert time.time() < deadline
    read_all(init, "target", i_reg, t_reg, b"done")
    # the initiator leaves: the target forgets it
    init.invalidate_local_metadata("127.0.0.1", tport)
    assert not target.check_remote_metadata("initiator")
    # asked again by an agent the target does not know: refused, named
    with pytest.raises(bindings.nixlRemoteDisconnectError, match="no agent \"initiator\" is loaded here"):
        init.invalidate_local_metadata("127.0.0.1", tport)


def test_partial_metadata_names_only_the_regions_sent():
    target, _ = agent("target")
    init, iport = agent("initiator")
    first, second = buffers(target, 3, 0x20), buffers(target, 3, 0x40)
    mine = buffers(init, 3, 0)
    target.send_partial_agent_metadata(first, True, ["UCX"], "127.0.0.1", iport)
    assert init.check_remote_metadata("target", first.trim())
    assert not init.check_remote_metadata("target", second.trim())
    read_all(init, "target", mine, first, b"one")
    # the second set was not sent: a transfer on it is refused before anything moves
    with pytest.raises(bindings.nixlNotFoundError, match="not inside memory target registered"):
        init.initialize_xfer("READ", mine.trim(), second.trim(), "target", b"two")
    target.send_partial_agent_metadata(second, True, ["UCX"], "127.0.0.1", iport)
    assert init.check_remote_metadata("target", first.trim())  # added to, not replaced
    assert init.check_remote_metadata("target", second.trim())
    read_all(init, "target", mine, second, b"two")


def test_partial_metadata_as_bytes_without_connection_details_needs_a_known_agent():
    target, _ = agent("target")
    init, _ = agent("initiator")
    first = buffers(target, 1, 1)
    md = target.get_partial_agent_metadata(first, False)
    with pytest.raises(bindings.nixlNotFoundError, match="load its metadata first"):
        init.add_remote_agent(md)
    assert init.add_remote_agent(target.get_partial_agent_metadata(first, True)) == b"target"
    assert init.check_remote_metadata("target", first.trim())
    # partial metadata of memory that is not registered
    with pytest.raises(bindings.nixlNotFoundError):
        target.get_partial_agent_metadata(target.get_reg_descs([(64, 8, 0, "")], "DRAM"), True)


def test_wrong_peers_and_closed_listeners_fail_with_nixls_types_bounded():
    a, aport = agent()
    quiet, qport = agent(listen=False)  # no listener thread: takes no metadata sent to it
    t0 = time.time()
    with pytest.raises(bindings.nixlRemoteDisconnectError, match="accept_sent_metadata is off"):
        a.send_local_metadata("127.0.0.1", qport)
    assert not quiet.check_remote_metadata(a.name)
    with pytest.raises(bindings.nixlMismatchError, match="not 'somebody-else'"):
        a.fetch_remote_metadata("somebody-else", "127.0.0.1", qport)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    for call in (
        lambda: a.send_local_metadata("127.0.0.1", port),
        lambda: a.fetch_remote_metadata("x", "127.0.0.1", port),
        lambda: a.invalidate_local_metadata("127.0.0.1", port),
    ):
        with pytest.raises(bindings.nixlRemoteDisconnectError, match="cannot connect"):
            call()
    assert time.time() - t0 < 10
    # no store: the address is needed
    with pytest.raises(bindings.nixlNotSupportedError, match="no metadata store"):
        a.send_local_metadata()
    assert not a.check_remote_metadata("nobody", a.get_xfer_descs([(1, 2, 0)], "DRAM"))


def test_garbage_and_stale_metadata_fail_with_nixls_types():
    a, _ = agent()
    with pytest.raises(bindings.nixlMismatchError):
        a.add_remote_agent(b"not metadata")
    gone, _ = agent("gone")
    md = gone.get_agent_metadata()
    del gone  # its listener closes
    import gc

    gc.collect()
    t0 = time.time()
    with pytest.raises(bindings.nixlRemoteDisconnectError):
        a.add_remote_agent(md)
    assert time.time() - t0 < 10 and not a.check_remote_metadata("gone")


def test_sent_metadata_must_name_the_host_it_came_from():
    # an agent advertising another host's address sends its metadata from loopback
    target, tport = agent("target")
    liar = nixl_agent(
        "liar",
        nixl_agent_config(True, True, 0, kvrail_config=dict(CFG, listen="0.0.0.0:0", side_channel_host="192.0.2.7", insecure=True)),
    )
    with pytest.raises(Exception, match="192.0.2.7"):
        liar.send_local_metadata("127.0.0.1", tport)
    assert not target.check_remote_metadata("liar")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    exe = shutil.which("etcd")
    if exe is None:
        pytest.skip("etcd is not installed (Debian: apt install etcd-server)")
    d = tmp_path_factory.mktemp("etcd")
    ports = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
        s.close()
    url = f"http://127.0.0.1:{ports[0]}"
    p = subprocess.Popen(
        [exe, "--data-dir", str(d / "data"), "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{ports[1]}"],
        stdout=open(d / "etcd.log", "w"), stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", ports[0]), 0.5).close()
            break
        except OSError:
            assert time.time() < deadline, "etcd did not start"
            time.sleep(0.2)
    yield url
    p.terminate()
    p.wait(10)


def test_partial_metadata_under_labels_through_etcd(etcd, monkeypatch):
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", etcd)
    monkeypatch.setenv("NIXL_ETCD_NAMESPACE", f"t{uuid.uuid4().hex[:8]}")
    target, _ = agent("target", listen=False)
    init, _ = agent("initiator", listen=False)
    first, second = buffers(target, 2, 0x30), buffers(target, 2, 0x50)
    mine = buffers(init, 2, 0)
    target.send_partial_agent_metadata(first, True, ["UCX"], label="label_1")
    init.fetch_remote_metadata("target", label="label_1")
    assert init.check_remote_metadata("target", first.trim())
    assert not init.check_remote_metadata("target", second.trim())
    read_all(init, "target", mine, first, b"one")
    with pytest.raises(bindings.nixlNotFoundError, match="label_9"):
        init.fetch_remote_metadata("target", label="label_9")
    with pytest.raises(bindings.nixlInvalidParamError, match="needs a label"):
        target.send_partial_agent_metadata(second, True, ["UCX"])
    target.send_partial_agent_metadata(second, True, ["UCX"], label="label_2")
    init.fetch_remote_metadata("target", label="label_2")
    read_all(init, "target", mine, second, b"two")
    # the target leaves the store: the initiator's watch forgets it
    target.invalidate_local_metadata()
    deadline = time.time() + 10
    while init.check_remote_metadata("target"):
        assert time.time() < deadline, "the initiator still knows the target 10 s after it left the store"
        time.sleep(0.05)
    with pytest.raises(bindings.nixlNotFoundError):
        init.fetch_remote_metadata("target", label="label_1")
    # and comes back
    target.send_local_metadata()
    init.fetch_remote_metadata("target")
    assert init.check_remote_metadata("target", second.trim())


def test_a_reads_notification_reaches_the_peer_when_it_is_forgotten_at_once():
    """NIXL's basic example: the initiator READs with a notification and, the moment the READ
    is done, removes the peer. The notification is queued before the READ is done; removing
    the peer sends what was queued first (before, the target waited forever, about 1 run in
    8 on a loaded host)."""
    for i in range(20):
        target, tport = agent(f"target-{i}")
        init, _ = agent(f"initiator-{i}")
        t_reg, i_reg = buffers(target, 1, i), buffers(init, 1, 0)
        init.fetch_remote_metadata(target.name, "127.0.0.1", tport)
        h = init.initialize_xfer("READ", i_reg.trim(), t_reg.trim(), target.name, b"Done_reading")
        assert init.transfer(h) != "ERR"
        while init.check_xfer_state(h) == "PROC":
            pass
        init.release_xfer_handle(h)
        init.remove_remote_agent(target.name)
        deadline = time.time() + 5
        while not target.check_remote_xfer_done(init.name, b"Done_reading"):
            assert time.time() < deadline, f"run {i}: the READ's notification never arrived"
