"""ferry.mooncake: Mooncake TE's Python API, as scripts use it."""

import ctypes
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
