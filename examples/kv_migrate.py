#!/usr/bin/python3
"""KV-cache migration, prefill -> decode, in two processes on ferry.mooncake.

The prefill process holds a paged KV cache: layers x blocks x block bytes
in one registered buffer, filled with data each block can be checked
against. For each request it WRITEs that request's (non-contiguous) blocks
of every layer into blocks the decode process has free, as one batch, and
notifies the decode process with the block mapping. The decode process
checks every block it received and prints the throughput.

    decode:  kv_migrate.py decode --metadata P2PHANDSHAKE --name-file F
    prefill: kv_migrate.py prefill --metadata P2PHANDSHAKE --peer "$(cat F)"

With a metadata service, --metadata is its address (or etcd://...), and
the decode process's segment is --name. Written against Mooncake TE's
Python API: with `from mooncake.engine import ...` instead of
`from ferry.mooncake import ...` it is a Mooncake program.
"""

import argparse
import ctypes
import json
import sys
import time

from ferry.mooncake import TransferEngine, TransferNotify, TransferOpcode


def pattern(layer: int, block: int, block_bytes: int) -> bytes:
    """What prefill's block `block` of layer `layer` holds."""
    head = f"L{layer:04d}B{block:06d}".encode()
    return (head * (block_bytes // len(head) + 1))[:block_bytes]


def start(args) -> TransferEngine:
    # Mooncake names a segment by local_hostname ("host:port") with a
    # metadata service, and by host:rpc_port in P2P mode.
    name = args.host if args.metadata == "P2PHANDSHAKE" else args.name
    engine = TransferEngine()
    if engine.initialize(name, args.metadata, args.protocol,
                         args.devices) != 0:
        sys.exit(f"initialize({name!r}, {args.metadata!r}) failed")
    return engine


def cache(engine: TransferEngine, args):
    size = args.layers * args.blocks * args.block_bytes
    buf = (ctypes.c_char * size)()
    addr = ctypes.addressof(buf)
    if engine.register_memory(addr, size) != 0:
        sys.exit("register_memory failed")
    return buf, addr


def block_addr(base: int, args, layer: int, block: int) -> int:
    return base + (layer * args.blocks + block) * args.block_bytes


def decode(args) -> int:
    engine = start(args)
    buf, base = cache(engine, args)
    name = (args.name if args.metadata != "P2PHANDSHAKE" else
            f"{args.host}:{engine.get_rpc_port()}")
    with open(args.name_file, "w") as f:
        f.write(name)
    received, checked, bad = 0, 0, 0
    first = None
    deadline = time.monotonic() + args.timeout
    while received < args.requests and time.monotonic() < deadline:
        notes = engine.get_notifies()
        if not notes:
            time.sleep(0.001)
            continue
        for note in notes:
            first = first or time.monotonic()
            if note.name != "kv-ready":
                continue
            msg = json.loads(note.msg)
            for src, dst in zip(msg["src"], msg["dst"]):
                for layer in range(args.layers):
                    a = block_addr(base, args, layer, dst)
                    got = ctypes.string_at(a, args.block_bytes)
                    checked += 1
                    if got != pattern(layer, src, args.block_bytes):
                        bad += 1
            received += 1
    elapsed = max(time.monotonic() - (first or time.monotonic()), 1e-9)
    moved = checked * args.block_bytes
    print(f"decode: {received}/{args.requests} requests, {checked} blocks "
          f"checked, {bad} bad, {moved / elapsed / 1e9:.2f} GB/s")
    return 0 if received == args.requests and bad == 0 and checked else 1


def prefill(args) -> int:
    engine = start(args)
    buf, base = cache(engine, args)
    for layer in range(args.layers):
        for block in range(args.blocks):
            ctypes.memmove(block_addr(base, args, layer, block),
                           pattern(layer, block, args.block_bytes),
                           args.block_bytes)
    peer_base = engine.get_first_buffer_address(args.peer)
    if peer_base == 0:
        sys.exit(f"no buffer in segment {args.peer!r}")
    per_request = args.blocks // args.requests
    start_time = time.monotonic()
    moved = 0
    for r in range(args.requests):
        # This request's blocks: every other one, from an offset (not
        # contiguous); the decode side's free blocks, in another order.
        src = [(r + 2 * i) % args.blocks for i in range(per_request)]
        dst = [r * per_request + (per_request - 1 - i)
               for i in range(per_request)]
        srcs, dsts, lens = [], [], []
        for layer in range(args.layers):
            for s, d in zip(src, dst):
                srcs.append(block_addr(base, args, layer, s))
                dsts.append(block_addr(peer_base, args, layer, d))
                lens.append(args.block_bytes)
        note = TransferNotify("kv-ready", json.dumps(
            {"request": r, "src": src, "dst": dst}))
        if engine.batch_transfer_sync(args.peer, srcs, dsts, lens,
                                      TransferOpcode.Write, note) != 0:
            sys.exit(f"request {r}: batch_transfer_sync failed")
        moved += sum(lens)
    elapsed = time.monotonic() - start_time
    print(f"prefill: {args.requests} requests, {moved} bytes, "
          f"{moved / elapsed / 1e9:.2f} GB/s")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--metadata", default="P2PHANDSHAKE")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    p.add_argument("--devices", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--name", default="",
                   help="this process's segment name, host:port (not P2P)")
    p.add_argument("--name-file", default="decode.name")
    p.add_argument("--peer", default="", help="decode's segment name")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-bytes", type=int, default=16 << 10)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--timeout", type=float, default=60)
    args = p.parse_args()
    return decode(args) if args.role == "decode" else prefill(args)


if __name__ == "__main__":
    sys.exit(main())
