#!/usr/bin/python3
"""Python overhead of ferry.mooncake, for docs/performance.md.

Two engines in this process (P2PHANDSHAKE, loopback), as transfer_bench
--mode=local runs its two:
  - batches of --batch x --block bytes with batch_transfer_sync_write, for
    --seconds: the rate, as transfer_bench reports it (GB/s);
  - --calls 8-byte transfer_sync_write calls: the median and p99 time per
    call (us).
Prints one JSON line.
"""

import argparse
import ctypes
import json
import statistics
import time

from ferry.mooncake import TransferEngine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--block", type=int, default=64 << 10)
    p.add_argument("--buffer", type=int, default=64 << 20)
    p.add_argument("--seconds", type=float, default=2)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()

    target, initiator = TransferEngine(), TransferEngine()
    for e in (target, initiator):
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", args.protocol, "") != 0:
            raise SystemExit("initialize failed")
    peer = f"127.0.0.1:{target.get_rpc_port()}"
    remote = (ctypes.c_char * args.buffer)()
    local = (ctypes.c_char * args.buffer)()
    raddr, laddr = ctypes.addressof(remote), ctypes.addressof(local)
    assert target.register_memory(raddr, args.buffer) == 0
    assert initiator.register_memory(laddr, args.buffer) == 0

    # Batches walk the whole buffer, as transfer_bench's do (the same few
    # blocks again and again would stay in cache).
    blocks = args.buffer // args.block
    batches = []
    for first in range(0, blocks, args.batch):
        offsets = [((first + i) % blocks) * args.block
                   for i in range(args.batch)]
        batches.append(([laddr + o for o in offsets],
                         [raddr + o for o in offsets]))
    lens = [args.block] * args.batch
    # One warm-up batch: connections up.
    assert initiator.batch_transfer_sync_write(peer, *batches[0], lens) == 0
    moved, n, start = 0, 0, time.monotonic()
    while time.monotonic() - start < args.seconds:
        srcs, dsts = batches[n % len(batches)]
        n += 1
        assert initiator.batch_transfer_sync_write(peer, srcs, dsts, lens) == 0
        moved += args.batch * args.block
    elapsed = time.monotonic() - start

    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        assert initiator.transfer_sync_write(peer, laddr, raddr, 8) == 0
        times.append(time.perf_counter() - t0)
    times.sort()
    print(json.dumps({
        "protocol": args.protocol, "batch": args.batch, "block": args.block,
        "seconds": round(elapsed, 3),
        "throughput_gbps": round(moved / elapsed / 1e9, 4),
        "sync_write_8b_p50_us": round(statistics.median(times) * 1e6, 1),
        "sync_write_8b_p99_us": round(times[int(len(times) * 0.99)] * 1e6, 1),
    }))


if __name__ == "__main__":
    main()
