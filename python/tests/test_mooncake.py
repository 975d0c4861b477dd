"""ferry.mooncake: Mooncake TE's Python API, as scripts use it."""

import ctypes
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import time

import pytest

from ferry.mooncake import (Read, TransferEngine, TransferNotify,
                            TransferOpcode, Write)


def p2p_engine():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return e


@pytest.fixture
def pair():
    target, initiator = p2p_engine(), p2p_engine()
    # As SGLang names a P2P peer: its host and RPC port.
    yield target, initiator, f"127.0.0.1:{target.get_rpc_port()}"
    initiator._close()
    target._close()


def test_opcodes_in_both_spellings():
    assert TransferOpcode.Read == TransferOpcode.READ == Read == 0
    assert TransferOpcode.Write == TransferOpcode.WRITE == Write == 1


def test_initialize_failures_are_negative():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "redis://127.0.0.1:1", "tcp", "") < 0
    assert e.get_rpc_port() == -1
    assert e.register_memory(1 << 20, 4096) == -1


def test_sync_writes_and_reads(pair):
    target, initiator, peer = pair
    remote = target.allocate_managed_buffer(1 << 20)
    assert remote != 0
    assert target.get_rpc_port() > 0
    local = initiator.allocate_managed_buffer(1 << 20)
    data = bytes(range(256)) * 16
    assert initiator.write_bytes_to_buffer(local, data, len(data)) == 0
    assert initiator.transfer_sync_write(peer, local, remote, len(data)) == 0
    assert target.read_bytes_from_buffer(remote, len(data)) == data
    back = local + (512 << 10)
    assert initiator.transfer_sync_read(peer, back, remote, len(data)) == 0
    assert initiator.read_bytes_from_buffer(back, len(data)) == data
    assert initiator.transfer_sync(peer, local, remote + 8192, 4096,
                                   TransferOpcode.Write) == 0
    assert initiator.get_first_buffer_address(peer) == remote
    assert initiator.free_managed_buffer(local, 1 << 20) == 0
    assert target.free_managed_buffer(remote, 1 << 20) == 0


def test_cluster_token_from_the_environment(monkeypatch):
    # initialize() cannot pass a secret: the environment gives it.
    monkeypatch.setenv("FERRY_AUTH_TOKEN", "python-env-token-0123456")
    target, member = p2p_engine(), p2p_engine()
    peer = f"127.0.0.1:{target.get_rpc_port()}"
    remote = target.allocate_managed_buffer(4096)
    local = member.allocate_managed_buffer(4096)
    assert member.write_bytes_to_buffer(local, b"k" * 4096, 4096) == 0
    assert member.transfer_sync_write(peer, local, remote, 4096) == 0
    assert target.read_bytes_from_buffer(remote, 4096) == b"k" * 4096
    monkeypatch.delenv("FERRY_AUTH_TOKEN")
    outsider = p2p_engine()
    theirs = outsider.allocate_managed_buffer(4096)
    # Without the token it cannot read the target's descriptor.
    assert outsider.transfer_sync_write(peer, theirs, remote, 4096) == -1
    assert target.read_bytes_from_buffer(remote, 4096) == b"k" * 4096
    for e in (outsider, member, target):
        e._close()


def test_batches_async_status_and_notify(pair):
    target, initiator, peer = pair
    size = 64 << 10
    blocks = 16
    remote = (ctypes.c_char * (size * blocks))()
    local = (ctypes.c_char * (size * blocks))()
    raddr, laddr = ctypes.addressof(remote), ctypes.addressof(local)
    assert target.batch_register_memory([raddr], [size * blocks]) == 0
    # Registered in two pieces, with one round trip.
    half = size * blocks // 2
    assert initiator.batch_register_memory([laddr, laddr + half],
                                           [half, half]) == 0
    ctypes.memset(laddr, 0x5c, size * blocks)
    srcs = [laddr + i * size for i in range(blocks)]
    dsts = [raddr + (blocks - 1 - i) * size for i in range(blocks)]
    lens = [size] * blocks
    assert initiator.batch_transfer_sync_write(peer, srcs, dsts, lens) == 0
    assert bytes(remote) == b"\x5c" * (size * blocks)
    ctypes.memset(laddr, 0, size * blocks)
    assert initiator.batch_transfer_sync_read(peer, srcs, dsts, lens) == 0
    assert bytes(local) == b"\x5c" * (size * blocks)
    # Async, then status over several batches.
    ids = [initiator.batch_transfer_async_write(peer, srcs, dsts, lens),
           initiator.batch_transfer_async_read(peer, srcs, dsts, lens),
           initiator.batch_transfer_async(peer, srcs, dsts, lens, Write)]
    assert all(i > 0 for i in ids)
    assert initiator.get_batch_transfer_status(ids) == 0
    bid = initiator.transfer_submit_write(peer, laddr, raddr, size)
    assert bid > 0
    status, deadline = 0, time.monotonic() + 10
    while status == 0 and time.monotonic() < deadline:
        status = initiator.transfer_check_status(bid)
    assert status == 1
    # With a notification, delivered once the data is in place.
    notify = TransferNotify("kv-ready", "req-7")
    assert initiator.batch_transfer_sync(peer, srcs, dsts, lens, Write,
                                         notify) == 0
    got = target.get_notifies()
    assert [(n.name, n.msg) for n in got] == [("kv-ready", "req-7")]
    # Ferry keeps the (checked) sender: the initiator, named by its address.
    assert got[0].sender.endswith(f":{initiator.get_rpc_port()}"), got[0]
    assert got[0].verified, got[0]
    assert target.get_notifies() == []
    assert initiator.send_probe(peer) == 0
    assert initiator.batch_unregister_memory([laddr, laddr + half]) == 0
    assert target.unregister_memory(raddr) == 0


def test_errors_are_negative(pair):
    target, initiator, peer = pair
    remote = target.allocate_managed_buffer(4096)
    unregistered = (ctypes.c_char * 4096)()
    uaddr = ctypes.addressof(unregistered)
    # Local memory not registered.
    assert initiator.transfer_sync_write(peer, uaddr, remote, 4096) == -1
    local = initiator.allocate_managed_buffer(4096)
    # A remote address outside every buffer.
    assert initiator.transfer_sync_read(peer, local, 0x1000, 4096) == -1
    # An unknown segment, a malformed name.
    assert initiator.transfer_sync_read("127.0.0.1:1", local, remote,
                                        4096) == -1
    assert initiator.transfer_sync_read("not-an-address", local, remote,
                                        4096) == -1
    assert initiator.send_probe("127.0.0.1:1") == -1
    assert initiator.batch_transfer_async_read(peer, [local], [], [8]) == 0
    assert initiator.batch_transfer_sync_read(peer, [local], [remote],
                                              [8, 8]) == -1
    assert initiator.unregister_memory(uaddr) == -1
    assert initiator.batch_register_memory([uaddr], [4096, 1]) == -1
    # Values that are not addresses or lengths, sync and async.
    for bad in (-1, "x", 1.5, 1 << 64):
        assert initiator.batch_transfer_sync_write(peer, [local, bad],
                                                   [remote, remote],
                                                   [8, 8]) == -1
        assert initiator.batch_transfer_async_write(peer, [local],
                                                    [remote], [bad]) == 0
        assert initiator.transfer_submit_write(peer, local, bad, 8) == -1
    # A failed submission's -1 given to the status calls.
    assert initiator.transfer_check_status(-1) == -1
    assert initiator.get_batch_transfer_status([-1]) == -1
    # The engine works on after all that.
    assert initiator.transfer_sync_read(peer, local, remote, 4096) == 0


def test_cuda_methods_need_an_engine():
    e = TransferEngine()
    with pytest.raises(RuntimeError, match="not initialized"):
        e.transfer_write_on_cuda("x", 0, 0, 1)


def test_with_a_metadata_service():
    import ferry
    with ferry.Engine(local_segment_name="md", listen_host="127.0.0.1") as md:
        a, b = TransferEngine(), TransferEngine()
        # As Mooncake: the segment is named by local_hostname.
        assert a.initialize("127.0.0.1:17001", md.metadata_address, "tcp",
                            "") == 0
        assert b.initialize("127.0.0.1:17002", md.metadata_address, "tcp",
                            "") == 0
        remote = a.allocate_managed_buffer(8192)
        local = b.allocate_managed_buffer(8192)
        b.write_bytes_to_buffer(local, b"\x11" * 8192, 8192)
        assert b.transfer_sync_write("127.0.0.1:17001", local, remote,
                                     8192) == 0
        assert a.read_bytes_from_buffer(remote, 8192) == b"\x11" * 8192
        assert b.get_first_buffer_address("127.0.0.1:17001") == remote


def test_ipv6_hostnames():
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("::1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("[::1]:0", "P2PHANDSHAKE", "tcp", "") == 0
    remote = a.allocate_managed_buffer(4096)
    local = b.allocate_managed_buffer(4096)
    peer = f"[::1]:{a.get_rpc_port()}"
    assert b.transfer_sync_write(peer, local, remote, 4096) == 0
    assert b.send_probe(peer) == 0
    b._close()
    a._close()


def test_probe_of_a_peer_that_went_keeps_working_after_it_returns(pair):
    target, initiator, peer = pair
    assert initiator.send_probe(peer) == 0
    assert initiator.send_probe("127.0.0.1:1") == -1  # Another, absent.
    remote = target.allocate_managed_buffer(4096)
    local = initiator.allocate_managed_buffer(4096)
    assert initiator.transfer_sync_write(peer, local, remote, 4096) == 0


def test_local_topology():
    import json
    # softrnic's NICs (the test runs on softrnic): no NUMA placement in
    # sysfs, so every NIC serves any location.
    matrix = json.loads(TransferEngine.get_local_topology())
    assert list(matrix) == ["*"]
    nics = matrix["*"][0]
    assert nics, matrix
    assert json.loads(TransferEngine.get_local_topology(nics[0])) == {
        "*": [[nics[0]]]}
    assert TransferEngine.get_local_topology("no-such-nic") == "{}"


def test_numpy_integers_and_arrays(pair):
    # Mooncake's binding converts with pybind11, which takes numpy's
    # integers and arrays as it takes ints and lists.
    numpy = pytest.importorskip("numpy")
    target, initiator, peer = pair
    remote = target.allocate_managed_buffer(4096)
    local = initiator.allocate_managed_buffer(4096)
    assert TransferEngine.write_bytes_to_buffer(local, "ferry!", 6) == 0
    assert initiator.transfer_sync_write(peer, numpy.int64(local),
                                         numpy.uint64(remote),
                                         numpy.int32(6)) == 0
    assert target.read_bytes_from_buffer(remote, 6) == b"ferry!"
    src = numpy.array([local, local + 8], dtype=numpy.uint64)
    dst = numpy.array([remote + 100, remote + 200], dtype=numpy.uint64)
    assert initiator.batch_transfer_sync_write(
        peer, src, dst, numpy.array([6, 6])) == 0
    assert target.read_bytes_from_buffer(remote + 100, 6) == b"ferry!"
    batch = initiator.batch_transfer_async_read(peer, src, dst,
                                                numpy.array([4, 4]))
    assert batch > 0
    assert initiator.get_batch_transfer_status([numpy.int64(batch)]) == 0
    assert initiator.batch_transfer_sync_write(
        peer, numpy.array([], dtype=numpy.uint64), [], []) == -1


# ---- Mooncake's clients, unchanged: SGLang's and vLLM's flow ----------

HERE = os.path.dirname(os.path.abspath(__file__))


def no_rdma_env():
    """The environment of a host with no RDMA device: the system's
    libibverbs (no kernel RDMA here) instead of softrnic's."""
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":")
             if p and "softrnic" not in p]
    return dict(os.environ, LD_LIBRARY_PATH=":".join(paths))


@pytest.mark.parametrize("case", ["tcp", "rdma", "rdma-no-device"])
def test_sglang_vllm_flow_between_two_processes(case):
    protocol = "tcp" if case == "tcp" else "rdma"
    env = dict(os.environ) if case != "rdma-no-device" else no_rdma_env()
    if case == "rdma-no-device":
        probe = subprocess.run(
            [sys.executable, "-c", "from ferry import _ferry; "
             "print(_ferry.local_topology(''))"],
            capture_output=True, text=True, env=env, timeout=60)
        assert probe.returncode != 0, (
            "this host has RDMA devices of its own, so it cannot stand for "
            "one without: " + probe.stdout)
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    peer = os.path.join(HERE, "mc_peer.py")
    log = tempfile.TemporaryFile(mode="w+")
    target = subprocess.Popen([sys.executable, peer, "target", protocol],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=log, text=True, env=env)

    def line():
        # Bounded: a target that hangs fails the test, with its log.
        ready, _, _ = select.select([target.stdout], [], [], 60)
        if not ready:
            log.seek(0)
            pytest.fail("the target said nothing for 60 s: " + log.read())
        return target.stdout.readline()

    try:
        hello = json.loads(line())
        assert "error" not in hello, hello
        want = "rdma" if case == "rdma" else "tcp"
        assert hello["transport"] == want, hello
        run = subprocess.run(
            [sys.executable, peer, "initiator", protocol, hello["session"],
             json.dumps(hello["layers"])],
            capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout.splitlines()[-1])
        assert out["transport"] == want, out
        assert out["probe_live"] == 0 and out["probe_dead"] == -1, out
        assert out["probe_dead_seconds"] < 10, out
        assert out["write"] == [0] * len(hello["layers"]), out
        assert out["read"] == 0 and out["verified"], out
        if case == "rdma-no-device":
            # Why it is TCP is said, not swallowed.
            assert "no RDMA device here" in run.stderr, run.stderr
        target.stdin.write("check 7\n")
        target.stdin.flush()
        assert line().strip() == "ok"
        target.stdin.write("quit\n")
        target.stdin.flush()
        assert target.wait(timeout=60) == 0
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()
        log.close()


def test_protocol_falls_back_as_mooncakes_does(monkeypatch, caplog):
    from ferry import _ferry
    from ferry.errors import FerryError
    from ferry.mooncake import _choose_transport
    caplog.set_level(logging.WARNING, logger="ferry.mooncake")
    # softrnic's NICs are here.
    assert _choose_transport("rdma", "", {}) == ("rdma", "")
    assert _choose_transport("tcp", "", {}) == ("tcp", "")
    assert _choose_transport("rdma", "", {"MC_FORCE_TCP": "1"}) == ("tcp", "")
    assert "MC_FORCE_TCP" in caplog.text
    # Only the cards named count, as in Mooncake's discovery: none of
    # them here is TCP; one of them is RDMA on it.
    caplog.clear()
    assert _choose_transport("rdma", "mlx5_9", {}) == ("tcp", "")
    assert "mlx5_9" in caplog.text
    assert _choose_transport("rdma", "", {"MC_TE_FILTERS": "mlx5_9"}) == (
        "tcp", "")
    assert _choose_transport("rdma", "softrnic0,mlx5_9", {}) == (
        "rdma", "softrnic0,mlx5_9")
    # No card at all: TCP, saying why; MC_FORCE_HCA insists on RDMA.
    def none(devices):
        raise FerryError(5, "no RDMA devices on this host")
    monkeypatch.setattr(_ferry, "local_topology", none)
    caplog.clear()
    assert _choose_transport("rdma", "", {}) == ("tcp", "")
    assert "no RDMA devices on this host" in caplog.text
    assert _choose_transport("rdma", "", {"MC_FORCE_HCA": "true"}) == (
        "rdma", "")
    # And initialize comes up on TCP.
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    assert json.loads(e.get_engine().stats())["transports"][0][
        "transport"] == "tcp"
    e._close()


def test_session_ids_split_as_mooncakes_parser_does():
    from ferry.mooncake import _session
    assert _session("::1:37739") == "[::1]:37739"
    assert _session("fe80::1:2:17000") == "[fe80::1:2]:17000"
    assert _session("[::1]:37739") == "[::1]:37739"
    assert _session("10.0.0.1:17000") == "10.0.0.1:17000"
    # A whole IPv6 address is not a host and a port.
    assert _session("2001:db8::1") == "2001:db8::1"
    assert _session("::1") == "::1"
    assert _session("a:b:c") == "a:b:c"


def test_unbracketed_ipv6_session_ids():
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("::1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("::1", "P2PHANDSHAKE", "tcp", "") == 0
    remote = a.allocate_managed_buffer(4096)
    local = b.allocate_managed_buffer(4096)
    b.write_bytes_to_buffer(local, b"\x5a" * 4096, 4096)
    # As SGLang's older wrapper and vLLM write them: split at the last colon.
    for peer in (f"::1:{a.get_rpc_port()}", f"[::1]:{a.get_rpc_port()}"):
        assert b.send_probe(peer) == 0, peer
        assert b.batch_transfer_sync_write(peer, [local], [remote],
                                           [4096]) == 0, peer
    assert a.read_bytes_from_buffer(remote, 4096) == b"\x5a" * 4096
    b._close()
    a._close()


def test_the_other_engine_methods(pair):
    target, initiator, peer = pair
    assert initiator.get_engine() is not None
    assert initiator.get_engine_ptr() != 0
    assert initiator.warmup_efa_segment(peer) == 0
    assert initiator.warmup_efa_segment("127.0.0.1:1") == -1
    e = TransferEngine()
    assert e.get_engine() is None and e.get_engine_ptr() == 0


def test_get_notifies_keeps_the_verified_flag():
    # With FERRY_REFUSE_UNVERIFIED_NOTIFICATIONS=0 the engine queues a
    # notification whose sender did not verify, marked so; get_notifies must
    # not drop the mark (it did). The engine's side: EngineNotifyTest.
    class Queued:
        def notifications(self):
            return [("prefill-0", "kv-ready", b"m", "ipv4:10.0.0.9", False),
                    ("prefill-1", "kv-ready", b"n", "ipv4:10.0.0.8", True)]

    engine = TransferEngine()
    engine._engine = Queued()
    got = engine.get_notifies()
    engine._engine = None
    assert [(n.sender, n.verified) for n in got] == [("prefill-0", False),
                                                      ("prefill-1", True)]
    assert "verified=False" in repr(got[0])
    assert "verified" not in repr(got[1])


def test_mc_variables_are_honoured_or_reported(caplog):
    from ferry import _mc_env
    caplog.set_level(logging.WARNING, logger="ferry.mooncake")
    env = {"MC_SLICE_SIZE": "131072", "MC_GID_INDEX": "3",
           "MC_RETRY_CNT": "9", "MC_IB_TC": "-1", "MC_LOG_LEVEL": "WARNING",
           "MC_TRANSFER_TIMEOUT": "5", "MC_MAX_SGE": "8",
           "MC_STORE_MEMCPY": "1", "MC_NO_SUCH": "x", "MC_FORCE_TCP": "1",
           "MC_NUM_QP_PER_EP": "many"}
    got = dict(_mc_env.options(env))
    assert got == {"rdma.slice_bytes": 131072, "rdma.gid_index": 3,
                   "rdma.max_attempts": 10, "log_level": "warn",
                   "transfer_timeout_ms": "5000"}
    # Ferry's own switch for what initialize() cannot pass.
    off = dict(_mc_env.options({"FERRY_REFUSE_UNVERIFIED_NOTIFICATIONS": "0"}))
    assert off == {"refuse_unverified_notifications": "0"}
    for name in ("MC_MAX_SGE", "MC_STORE_MEMCPY", "MC_NO_SUCH",
                 "MC_NUM_QP_PER_EP"):
        assert name in caplog.text, name
    assert "MC_FORCE_TCP" not in caplog.text  # Honoured by initialize.
    # Once a process.
    caplog.clear()
    _mc_env.options(env)
    assert "MC_MAX_SGE" not in caplog.text
    # And an engine takes them.
    os.environ["MC_TCP_SLICE_SIZE"] = "65536"
    try:
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        e._close()
        os.environ["MC_HANDSHAKE_PORT"] = "99999"  # Refused: said why.
        caplog.clear()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
        assert "rpc_port" in caplog.text
    finally:
        del os.environ["MC_TCP_SLICE_SIZE"]
        os.environ.pop("MC_HANDSHAKE_PORT", None)
