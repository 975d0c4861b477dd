"""The decode side of test_gpu's vLLM-shaped flow, in a process of its own:
KV-cache layers in (emulated) GPU memory, registered with ferry.mooncake's
batch_register_memory as vLLM's MooncakeConnector does. Commands on stdin,
one answer line each on stdout:
  check SEED  -> "ok" if every layer holds softgpu.pattern(SEED)
  fill SEED   -> writes that pattern into every layer
  quit
"""

import json
import sys

import softgpu
from ferry.mooncake import TransferEngine

LAYERS, LAYER_BYTES = 4, 1 << 20


def main():
    protocol = sys.argv[1]
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
        print(json.dumps({"error": "initialize failed"}), flush=True)
        return 1
    layers = [softgpu.alloc(1, LAYER_BYTES) for _ in range(LAYERS)]
    if engine.batch_register_memory(layers, [LAYER_BYTES] * LAYERS) != 0:
        print(json.dumps({"error": "batch_register_memory failed"}),
              flush=True)
        return 1
    print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}",
                      "layers": layers, "layer_bytes": LAYER_BYTES}),
          flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        want = softgpu.pattern(LAYER_BYTES, int(cmd[1]))
        if cmd[0] == "fill":
            for p in layers:
                softgpu.to_device(p, want)
            print("ok", flush=True)
        elif cmd[0] == "check":
            bad = [i for i, p in enumerate(layers)
                   if softgpu.from_device(p, LAYER_BYTES) != want]
            print("ok" if not bad else f"bad layers {bad}", flush=True)
    engine.batch_unregister_memory(layers)
    engine._close()
    for p in layers:
        softgpu.free(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
