"""GPU memory from Python, on softgpu's emulated GPUs: registering the
objects applications hold device memory in, and a vLLM-shaped prefill ->
decode flow between two processes (P2PHANDSHAKE, batch_register_memory of
device pointers, batch_transfer_sync_write), over tcp and rdma (softrnic),
every byte checked through the driver."""

import ctypes
import json
import os
import subprocess
import sys

import pytest

import ferry
import softgpu
from ferry.mooncake import TransferEngine


@pytest.fixture
def engine():
    e = ferry.Engine(local_segment_name="py-gpu", listen_host="127.0.0.1",
                     transports=["tcp"])
    yield e
    e.close()


def test_objects_are_registered_by_kind_and_device(engine):
    cai = softgpu.DeviceArray(1, (64, 1024))
    torch_like = softgpu.TorchLike(1, 1 << 16)
    dl = softgpu.DLPackArray(0, 1 << 16)
    try:
        assert engine.register(cai) == cai.ptr
        assert ferry.address_of(cai) == cai.ptr
        assert engine.register(torch_like) == torch_like.data_ptr()
        assert engine.register(dl) == dl.ptr
        # The device comes from the object: naming another one is refused.
        engine.unregister(torch_like)
        with pytest.raises(ferry.FerryError) as e:
            engine.register(torch_like, location="cuda:0")
        assert e.value.code == ferry.errors.INVALID_ARGUMENT
        assert "cuda:1" in e.value.message
        engine.unregister(cai)
        engine.unregister(dl)
    finally:
        cai.free()
        torch_like.free()
        dl.free()


def test_size_one_dimensions_may_have_any_stride(engine):
    # Producers put anything in a size-1 dimension's stride: still packed.
    arr = softgpu.DeviceArray(0, (4096, 1), strides=(1, 12345))
    try:
        assert engine.register(arr) == arr.ptr
        engine.unregister(arr)
    finally:
        arr.free()


def test_strided_and_unknown_objects_are_refused(engine):
    strided = softgpu.DeviceArray(0, (4, 4), strides=(8, 1))
    view = softgpu.TorchLike(0, 4096, contiguous=False)
    try:
        for obj in (strided, view):
            with pytest.raises(ferry.FerryError) as e:
                engine.register(obj)
            assert "contiguous" in e.value.message
    finally:
        strided.free()
        view.free()


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_vllm_shaped_prefill_to_decode(protocol):
    here = os.path.dirname(os.path.abspath(__file__))
    decode = subprocess.Popen(
        [sys.executable, os.path.join(here, "gpu_peer.py"), protocol],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [here, os.environ.get("PYTHONPATH", "")])))

    def ask(command):
        decode.stdin.write(command + "\n")
        decode.stdin.flush()
        return decode.stdout.readline().strip()

    prefill = TransferEngine()
    local = []
    try:
        hello = json.loads(decode.stdout.readline())
        assert "error" not in hello, hello
        session, remote = hello["session"], hello["layers"]
        n = hello["layer_bytes"]
        assert prefill.initialize("127.0.0.1", "P2PHANDSHAKE", protocol,
                                  "") == 0
        local = [softgpu.alloc(0, n) for _ in remote]
        for p in local:
            softgpu.to_device(p, softgpu.pattern(n, 5))
        assert prefill.batch_register_memory(local, [n] * len(local)) == 0
        # Prefill writes its KV cache into decode's layers.
        assert prefill.batch_transfer_sync_write(session, local, remote,
                                                 [n] * len(local)) == 0
        assert ask("check 5") == "ok"
        # And reads theirs back (the other direction).
        assert ask("fill 9") == "ok"
        for p in local:
            softgpu.to_device(p, bytes(n))
        assert prefill.batch_transfer_sync_read(session, local, remote,
                                                [n] * len(local)) == 0
        for p in local:
            assert softgpu.from_device(p, n) == softgpu.pattern(n, 9)
        ask("quit")
        assert decode.wait(timeout=60) == 0
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait()
        prefill._close()
        for p in local:
            softgpu.free(p)


def test_on_cuda_transfers_run_in_stream_order():
    lib = softgpu.driver()
    target, initiator = TransferEngine(), TransferEngine()
    n = 1 << 20
    remote, local = softgpu.alloc(1, n), softgpu.alloc(0, n)
    stream = ctypes.c_void_p()
    try:
        assert target.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert initiator.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp",
                                    "") == 0
        session = f"127.0.0.1:{target.get_rpc_port()}"
        assert target.register_memory(remote, n) == 0
        assert initiator.register_memory(local, n) == 0
        softgpu.use_device(0)
        softgpu.check(lib.cuStreamCreate(ctypes.byref(stream), 1),
                      "cuStreamCreate")
        want = softgpu.pattern(n, 3)
        # Held, the copy cannot run before the transfer is queued: the
        # transfer sees its bytes only in stream order.
        assert lib.softgpu_hold_streams(1) == 0
        softgpu.check(lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(local), want,
                                               ctypes.c_size_t(n), stream),
                      "cuMemcpyHtoDAsync")
        initiator.transfer_write_on_cuda(session, local, remote, n,
                                         stream_ptr=stream.value)
        assert lib.softgpu_hold_streams(0) == 0
        softgpu.check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
        assert softgpu.from_device(remote, n) == want
        initiator.cuda_transfer_error()  # None failed.
        # A failure cannot fail the stream: it is raised afterwards.
        initiator.batch_transfer_write_on_cuda(session, [local],
                                               [remote + n], [n],
                                               stream_ptr=stream.value)
        softgpu.check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
        with pytest.raises(RuntimeError, match="1 transfer"):
            initiator.cuda_transfer_error()
    finally:
        lib.softgpu_hold_streams(0)
        if stream.value:
            lib.cuStreamDestroy_v2(stream)
        initiator._close()
        target._close()
        softgpu.free(local)
        softgpu.free(remote)


def test_on_cuda_without_a_driver_raises_saying_so():
    code = (
        "from ferry.mooncake import TransferEngine\n"
        "e = TransferEngine()\n"
        "assert e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
        "try:\n"
        "    e.transfer_write_on_cuda(f'127.0.0.1:{e.get_rpc_port()}',\n"
        "                             4096, 4096, 16)\n"
        "except RuntimeError as err:\n"
        "    print('raised:', err)\n")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        timeout=60,
        env=dict(os.environ, FERRY_CUDA_LIBRARY="/nonexistent/libcuda.so.1"))
    assert "raised:" in out.stdout and "CUDA driver" in out.stdout, (
        out.stdout + out.stderr)
