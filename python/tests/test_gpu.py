"""GPU memory from Python, on softgpu's emulated GPUs: registering the
objects applications hold device memory in, and a vLLM-shaped prefill ->
decode flow between two processes (P2PHANDSHAKE, batch_register_memory of
device pointers, batch_transfer_sync_write), over tcp and rdma (softrnic),
every byte checked through the driver."""

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
