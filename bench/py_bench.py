#!/usr/bin/python3
"""Python overhead of ferry.mooncake, for docs/performance.md.

An initiator engine in this process and, with --target=host:port, a
target in another (transfer_bench --mode=target, P2PHANDSHAKE), as
transfer_bench --mode=initiator runs against it; without --target, two
engines in this process, as transfer_bench --mode=local runs its two:
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
    p.add_argument("--target", default="",
                   help="host:port of a P2PHANDSHAKE target with a buffer of "
                   "--buffer bytes (default: one in this process)")
    args = p.parse_args()

    engines = [TransferEngine() for _ in range(1 if args.target else 2)]
    for e in engines:
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", args.protocol, "") != 0:
            raise SystemExit("initialize failed")
    initiator = engines[-1]
    # Filled, as transfer_bench fills its buffers: every page present.
    local = (ctypes.c_char * args.buffer)()
    ctypes.memset(local, 1, args.buffer)
    laddr = ctypes.addressof(local)
    assert initiator.register_memory(laddr, args.buffer) == 0
    if args.target:
        peer = args.target
        raddr = initiator.get_first_buffer_address(peer)
        if raddr <= 0:
            raise SystemExit(f"target {peer} has no buffer")
    else:
        target = engines[0]
        peer = f"127.0.0.1:{target.get_rpc_port()}"
        remote = (ctypes.c_char * args.buffer)()
        ctypes.memset(remote, 2, args.buffer)
        raddr = ctypes.addressof(remote)
        assert target.register_memory(raddr, args.buffer) == 0

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
    # The 8-byte calls first, as transfer_bench measures them: in a fresh
    # process (after the bulk phase, loopback TCP answers slower).
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        assert initiator.transfer_sync_write(peer, laddr, raddr, 8) == 0
        times.append(time.perf_counter() - t0)
    times.sort()
    moved, n, start = 0, 0, time.monotonic()
    while time.monotonic() - start < args.seconds:
        srcs, dsts = batches[n % len(batches)]
        n += 1
        assert initiator.batch_transfer_sync_write(peer, srcs, dsts, lens) == 0
        moved += args.batch * args.block
    elapsed = time.monotonic() - start

    print(json.dumps({
        "protocol": args.protocol, "batch": args.batch, "block": args.block,
        "seconds": round(elapsed, 3),
        "throughput_gbps": round(moved / elapsed / 1e9, 4),
        "sync_write_8b_p50_us": round(statistics.median(times) * 1e6, 1),
        "sync_write_8b_p99_us": round(times[int(len(times) * 0.99)] * 1e6, 1),
    }))


if __name__ == "__main__":
    main()
