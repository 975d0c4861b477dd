"""The pythonic layer (ferry): engines over loopback in this process."""

import ctypes
import gc
import threading
import time

import pytest

import ferry
from ferry import _ferry, errors


def start(name, metadata="embedded"):
    return ferry.Engine(local_segment_name=name, listen_host="127.0.0.1",
                        metadata_endpoint=metadata)


@pytest.fixture
def pair():
    target = start("py-target")
    initiator = start("py-initiator", target.metadata_address)
    yield target, initiator
    initiator.close()
    target.close()


def test_bad_options_raise_with_code_and_message():
    with pytest.raises(ferry.FerryError) as e:
        ferry.Engine(no_such_option=1)
    assert e.value.code == errors.INVALID_ARGUMENT
    assert "no_such_option" in e.value.message
    with pytest.raises(ferry.FerryError) as e:
        ferry.Engine(metadata_endpoint="redis://x:1")
    assert e.value.code == errors.INVALID_ARGUMENT
    assert "INVALID_ARGUMENT" in str(e.value)


def test_every_option_by_name_and_nested():
    # Dotted names, and dicts for the nested structs, reach the C API's
    # names (engine/capi/option_names.h); a bad nested value names itself.
    with ferry.Engine(local_segment_name="py-opts", listen_host="127.0.0.1",
                      tcp={"max_slice_bytes": 1 << 20, "frame_timeout_ms": 5000},
                      **{"rdma.slice_bytes": 1 << 17},
                      wait_spin_us=0) as e:
        assert e.segment_name == "py-opts"
    with pytest.raises(ferry.FerryError) as err:
        ferry.Engine(tcp={"port": 70000})
    assert err.value.code == errors.INVALID_ARGUMENT
    assert "tcp.port" in err.value.message


def test_stats_have_every_transport_and_nic(pair):
    target, initiator = pair
    buf = bytearray(4096)
    target.register(buf)
    local = bytearray(b"x" * 4096)
    initiator.register(local)
    seg = initiator.open_segment("py-target")
    initiator.batch([ferry.Request.write(ferry.address_of(local), seg,
                                         ferry.address_of(buf), 4096)]).wait(10)
    s = initiator.stats()
    assert s["segments_open"] == 1
    (tcp,) = s["transports"]
    assert tcp["transport"] == "tcp"
    assert tcp["nics"][0]["bytes"] >= 4096
    assert "staging_copy_bytes" in tcp and "mr_cache_evictions" in s


def test_write_read_and_notify(pair):
    target, initiator = pair
    remote = bytearray(1 << 20)
    local = bytearray(range(256)) * 4096
    back = bytearray(len(local))
    raddr = target.register(remote)
    laddr = initiator.register(local, remote_accessible=False)
    baddr = initiator.register(back, remote_accessible=False)
    seg = initiator.open_segment("py-target")
    batch = initiator.batch([ferry.Request.write(laddr, seg, raddr, len(local))])
    assert batch.wait(timeout=10) == (ferry.COMPLETED, len(local))
    assert remote == local
    batch.free()
    batch = initiator.batch([ferry.Request.read(baddr, seg, raddr, len(back))])
    state, moved = batch.wait(timeout=10)
    assert state == ferry.COMPLETED and moved == len(back)
    assert back == local
    batch.free()
    initiator.notify(seg, "kv-ready", b"layer\x000")
    got = target.notifications()
    assert len(got) == 1
    assert got[0].from_segment == "py-initiator"
    assert got[0].message == b"layer\x000"
    assert got[0].sender_verified
    for e, b in ((target, remote), (initiator, local), (initiator, back)):
        e.unregister(b)


def test_errors_of_requests(pair):
    target, initiator = pair
    remote = bytearray(4096)
    raddr = target.register(remote)
    local = bytearray(4096)
    seg = initiator.open_segment("py-target")
    # Local memory not registered: refused at submission, naming it.
    with pytest.raises(ferry.FerryError) as e:
        initiator.batch([ferry.Request.read(ferry.address_of(local), seg,
                                            raddr, 4096)])
    assert e.value.code == errors.INVALID_ARGUMENT
    assert "request 0" in e.value.message
    laddr = initiator.register(local, remote_accessible=False)
    # A remote range in no buffer: the request fails and says why.
    batch = initiator.batch([ferry.Request.read(laddr, seg, 0x10, 4096)])
    state, _ = batch.wait(timeout=10)
    assert state == ferry.FAILED
    state, moved, error = batch.status(0)
    assert state == ferry.FAILED and moved == 0
    assert error.code == errors.INVALID_ARGUMENT
    batch.free()
    with pytest.raises(ferry.FerryError) as e:
        initiator.open_segment("nobody")
    assert e.value.code == errors.NOT_FOUND
    initiator.unregister(local)
    target.unregister(remote)


def test_one_call_batches_of_the_extension(pair):
    # The extension's one-opcode batches (ferry.mooncake's path): three
    # parallel sequences; anything not an address or length is refused
    # before a batch exists, naming the item.
    target, initiator = pair
    remote, local = bytearray(b"r" * 4096), bytearray(b"l" * 4096)
    raddr, laddr = target.register(remote), initiator.register(local)
    raw, seg = initiator._raw(), initiator.open_segment("py-target")
    for bad, where in ((-1, "buffers[1]"), ("x", "buffers[1]"),
                       (1 << 64, "buffers[1]")):
        with pytest.raises(ferry.FerryError) as e:
            raw.transfer_same(_ferry.WRITE, seg, [laddr, bad],
                              [raddr, raddr], [8, 8])
        assert e.value.code == errors.INVALID_ARGUMENT
        assert where in e.value.message
    with pytest.raises(ferry.FerryError) as e:
        raw.submit_same(_ferry.WRITE, seg, [laddr], [raddr, raddr], [8])
    assert "differ in count (1, 2, 1)" in e.value.message
    with pytest.raises(ferry.FerryError) as e:
        raw.submit_same(_ferry.WRITE, seg, [], [], [])
    assert e.value.code == errors.INVALID_ARGUMENT
    with pytest.raises(ferry.FerryError):
        raw.transfer_same(_ferry.WRITE, seg, 5, [raddr], [8])
    # A request the engine refuses (local memory not registered) leaves
    # no batch behind, and the good one moves the bytes.
    with pytest.raises(ferry.FerryError) as e:
        raw.transfer_same(_ferry.WRITE, seg, [0x10], [raddr], [8])
    assert "request 0" in e.value.message
    state, total, done, failed, moved = raw.transfer_same(
        _ferry.WRITE, seg, (laddr, laddr + 8), (raddr, raddr + 100), (8, 8))
    assert (state, total, done, failed, moved) == (ferry.COMPLETED, 2, 2, 0,
                                                   16)
    assert remote[:8] == b"l" * 8 and remote[100:108] == b"l" * 8
    assert remote[8:100] == b"r" * 92
    batch = raw.submit_same(_ferry.READ, seg, [laddr], [raddr + 200], [4])
    assert raw.wait(batch, 10000)[0] == ferry.COMPLETED
    raw.free_batch(batch)
    initiator.unregister(local)
    target.unregister(remote)


def test_registered_buffers_are_pinned(pair):
    target, _ = pair
    buf = bytearray(4096)
    target.register(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x")  # Would move the memory peers write into.
    target.unregister(buf)
    buf.extend(b"x")  # Free again.
    # A registered object lives while registered, even with no other
    # reference.
    addr = target.register(bytearray(b"\x07" * 4096))
    gc.collect()
    assert ctypes.string_at(addr, 4096) == b"\x07" * 4096
    target.unregister(addr)
    with pytest.raises(ferry.FerryError) as e:
        target.register(b"read-only bytes")
    assert e.value.code == errors.INVALID_ARGUMENT
    # Registered to send from, a read-only buffer is never READ into.
    ro = b"\x01" * 4096
    roaddr = target.register(ro, remote_accessible=False)
    seg = target.open_segment("py-target")
    with pytest.raises(ferry.FerryError) as e:
        target.batch([ferry.Request.read(roaddr, seg, 0x1000, 16)])
    assert e.value.code == errors.INVALID_ARGUMENT
    assert "read-only" in e.value.message
    target.unregister(ro)


def test_wait_releases_the_gil(pair):
    target, initiator = pair
    # While one thread waits for a large transfer, another keeps running.
    size = 64 << 20
    remote = bytearray(size)
    raddr = target.register(remote)
    local = bytearray(size)
    laddr = initiator.register(local, remote_accessible=False)
    seg = initiator.open_segment("py-target")
    ticks = [0]
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.0005)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        time.sleep(0.01)
        b = initiator.batch([ferry.Request.write(laddr, seg, raddr, size)])
        before = ticks[0]
        start_time = time.monotonic()
        state = b.wait(timeout=30)[0]
        waited = time.monotonic() - start_time
        during = ticks[0] - before
    finally:
        stop.set()
        t.join()
    assert state == ferry.COMPLETED
    b.free()
    assert during >= 5, f"the other thread ran {during} times in {waited:.3f} s"
    initiator.unregister(local)
    target.unregister(remote)


def test_closed_engine_raises():
    e = start("py-closed")
    e.close()
    with pytest.raises(ferry.FerryError) as err:
        e.open_segment("x")
    assert err.value.code == errors.FAILED_PRECONDITION
    e.close()  # Idempotent.


def test_several_threads_share_an_engine(pair):
    target, initiator = pair
    threads_n, size = 4, 1 << 16
    remote = bytearray(threads_n * size)
    raddr = target.register(remote)
    local = bytearray(threads_n * size)
    laddr = initiator.register(local, remote_accessible=False)
    seg = initiator.open_segment("py-target")
    errors_seen = []

    def worker(i):
        try:
            off = i * size
            for round_ in range(20):
                local[off:off + size] = bytes([i * 20 + round_]) * size
                b = initiator.batch([ferry.Request.write(
                    laddr + off, seg, raddr + off, size)])
                assert b.wait(timeout=10)[0] == ferry.COMPLETED
                b.free()
                assert remote[off:off + size] == local[off:off + size]
        except Exception as e:  # Reported below, on the test's thread.
            errors_seen.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts), "a worker hung"
    assert not errors_seen, errors_seen
    initiator.unregister(local)
    target.unregister(remote)


def wait_in_thread(batch):
    """Waits for `batch` on a new thread: (the thread, [its state or, if
    the engine closed under it, the error code])."""
    result = []

    def waiter():
        try:
            result.append(batch.wait(timeout=30)[0])
        except ferry.FerryError as e:  # Closed under it: an error, no crash.
            result.append(e.code)

    t = threading.Thread(target=waiter)
    t.start()
    return t, result


def test_close_while_another_thread_waits():
    target = start("py-close-target")
    initiator = start("py-close-init", target.metadata_address)
    size = 64 << 20
    remote, local = bytearray(size), bytearray(size)
    raddr = target.register(remote)
    laddr = initiator.register(local, remote_accessible=False)
    seg = initiator.open_segment("py-close-target")
    b = initiator.batch([ferry.Request.write(laddr, seg, raddr, size)])
    t, result = wait_in_thread(b)
    initiator.close()  # The waiting call keeps the engine until it returns.
    t.join(timeout=60)
    assert not t.is_alive()
    assert len(result) == 1
    with pytest.raises(ferry.FerryError):
        b.wait(timeout=1)
    target.close()


def test_close_keeps_registered_objects_until_the_engine_is_gone():
    # A READ into an array only the engine references, waited on by another
    # thread, and the engine closed under it: the array must live until
    # the engine has really shut down (the READ may still land in it), and
    # be released then. Dropping it at close() crashed (3 runs in 3).
    numpy = pytest.importorskip("numpy")
    import gc
    import weakref
    target = start("py-pin-target")
    initiator = start("py-pin-init", target.metadata_address)
    size = 128 << 20
    remote = bytearray(b"R" * size)
    raddr = target.register(remote)
    local = numpy.zeros(size, dtype=numpy.uint8)
    laddr = initiator.register(local, remote_accessible=False)
    ref = weakref.ref(local)
    del local
    seg = initiator.open_segment("py-pin-target")
    b = initiator.batch([ferry.Request.read(laddr, seg, raddr, size)])
    t, result = wait_in_thread(b)
    time.sleep(0.002)
    initiator.close()
    if t.is_alive():  # The wait still holds the engine: so is the array.
        assert ref() is not None
    t.join(timeout=60)
    assert not t.is_alive() and len(result) == 1
    gc.collect()
    assert ref() is None, "the engine is gone but the array is still pinned"
    target.unregister(remote)
    target.close()
