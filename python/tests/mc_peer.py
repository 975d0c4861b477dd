"""One side of test_mooncake's SGLang/vLLM-shaped flow, in a process of
its own, written as those clients are: `from mooncake.engine import
TransferEngine` (Ferry's stand-in), P2PHANDSHAKE, batch_register_memory of
host buffers.

  mc_peer.py target PROTOCOL
      registers LAYERS buffers and prints {"session", "layers",
      "layer_bytes", "transport"}; then commands on stdin, one answer line
      each: "check SEED" ("ok" if every layer holds pattern(SEED)), quit.
  mc_peer.py initiator PROTOCOL SESSION LAYERS_JSON
      writes pattern(SEED) into the target's layers with
      batch_transfer_sync_write from a thread pool, one layer a thread,
      reads them back with batch_transfer_sync_read, probes the live peer
      and a dead one; prints {"transport", "probe_live", "probe_dead",
      "probe_dead_seconds", "write", "read", "verified"}.
"""

import ctypes
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from mooncake.engine import TransferEngine

LAYERS, LAYER_BYTES, SEED = 4, 1 << 20, 7


def pattern(n, seed):
    return bytes((i * 31 + seed) & 0xFF for i in range(256)) * (n // 256)


def buffers(engine):
    bufs = [(ctypes.c_char * LAYER_BYTES)() for _ in range(LAYERS)]
    addrs = [ctypes.addressof(b) for b in bufs]
    if engine.batch_register_memory(addrs, [LAYER_BYTES] * LAYERS) != 0:
        raise SystemExit(json.dumps({"error": "batch_register_memory"}))
    return bufs, addrs


def transport(engine):
    """The transport initialize chose (Ferry's counters name it)."""
    return json.loads(engine.get_engine().stats())["transports"][0][
        "transport"]


def target(protocol):
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
        print(json.dumps({"error": "initialize failed"}), flush=True)
        return 1
    bufs, addrs = buffers(engine)
    print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}",
                      "layers": addrs, "layer_bytes": LAYER_BYTES,
                      "transport": transport(engine)}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        want = pattern(LAYER_BYTES, int(cmd[1]))
        bad = [i for i, b in enumerate(bufs) if b.raw != want]
        print("ok" if not bad else f"bad layers {bad}", flush=True)
    engine.batch_unregister_memory(addrs)
    return 0


def initiator(protocol, session, remote):
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
        print(json.dumps({"error": "initialize failed"}), flush=True)
        return 1
    bufs, addrs = buffers(engine)
    for b in bufs:
        ctypes.memmove(b, pattern(LAYER_BYTES, SEED), LAYER_BYTES)
    out = {"transport": transport(engine),
           "probe_live": engine.send_probe(session)}
    start = time.monotonic()
    out["probe_dead"] = engine.send_probe("127.0.0.1:1")
    out["probe_dead_seconds"] = time.monotonic() - start
    # SGLang's and vLLM's connectors write layers from a thread pool.
    with ThreadPoolExecutor(max_workers=LAYERS) as pool:
        results = list(pool.map(
            lambda i: engine.batch_transfer_sync_write(
                session, [addrs[i]], [remote[i]], [LAYER_BYTES]),
            range(LAYERS)))
    out["write"] = results
    for b in bufs:
        ctypes.memset(b, 0, LAYER_BYTES)
    out["read"] = engine.batch_transfer_sync_read(session, addrs, remote,
                                                  [LAYER_BYTES] * LAYERS)
    out["verified"] = all(b.raw == pattern(LAYER_BYTES, SEED) for b in bufs)
    print(json.dumps(out), flush=True)
    engine.batch_unregister_memory(addrs)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "target":
        sys.exit(target(sys.argv[2]))
    sys.exit(initiator(sys.argv[2], sys.argv[3], json.loads(sys.argv[4])))
