#!/usr/bin/env python3
"""The package graph's check: no cycle between packages, and no edge that
points upward.

Reads the direct dependencies of every production target (testonly ones
are left out: a test may reach anything below it) with `bazel query`,
folds them into package edges, and checks them against LAYERS: a package
may depend only on packages of a lower layer. A package missing from
LAYERS is an error too, so a new one is placed deliberately.

Usage: devtools/layering.py [--graph FILE]   (FILE: `bazel query
--output=graph` output to read instead of running bazel, for tests).
Prints what it found and ends with "N passed, N failed" (one check).
"""

import argparse
import collections
import re
import subprocess
import sys

# Lowest first. A package may depend only on packages of a lower layer
# (CONTRIBUTING.md's table, bottom up).
LAYERS = [
    ["//include", "//bazel"],
    ["//common"],
    ["//descriptor", "//gpu"],
    ["//gpu/softgpu", "//metadata/proto", "//testing"],
    ["//transport/softrnic", "//metadata"],
    ["//transport", "//metadata/etcd"],
    ["//transport/rdma", "//transport/shm", "//transport/tcp",
     "//metadata/address"],
    ["//transport/registry"],
    ["//engine"],
    ["//engine/capi"],
    ["//bench"],
    ["//python", "//docs/examples", "//examples", "//examples/c", "//tools"],
    ["//tests", "//docs", "//devtools", "//"],
]

# Stacks that share layers but must not meet: no package under one prefix
# may depend on one under the other (the transports never use the metadata
# plane, nor it them; the engine is where they meet).
SEPARATE = [("//transport", "//metadata")]

QUERY = ('let t = (kind("rule", //...) except attr(testonly, 1, //...)) '
         'in deps($t, 1) intersect //...')


def package_edges(graph_text):
    """{package: {package it depends on}} from `--output=graph` text."""
    edges = collections.defaultdict(set)
    for line in graph_text.splitlines():
        m = re.match(r'\s*"([^"]+)"\s*->\s*"([^"]+)"', line)
        if not m:
            continue
        # Nodes may be groups of labels joined by "\n".
        for a in m.group(1).split("\\n"):
            for b in m.group(2).split("\\n"):
                pa, pb = a.split(":")[0], b.split(":")[0]
                if pa != pb and pa.startswith("//") and pb.startswith("//"):
                    edges[pa].add(pb)
    return edges


def check(edges):
    """Problems (strings) of the package graph `edges`."""
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    problems = []
    packages = sorted(set(edges) | {b for v in edges.values() for b in v})
    for p in packages:
        if p not in rank:
            problems.append(f"{p}: not in devtools/layering.py's LAYERS")
    def under(p, prefix):
        return p == prefix or p.startswith(prefix + "/")

    for a in sorted(edges):
        for b in sorted(edges[a]):
            for x, y in SEPARATE:
                if (under(a, x) and under(b, y)) or (under(a, y) and under(b, x)):
                    problems.append(f"{a} -> {b}: {x} and {y} must not meet")
            if a in rank and b in rank and rank[b] >= rank[a]:
                what = "sideways" if rank[b] == rank[a] else "upward"
                problems.append(f"{a} -> {b}: an edge {what} "
                                f"(layer {rank[a]} -> {rank[b]})")
    # Cycles, whatever the layers say.
    state = {}

    def visit(p, stack):
        state[p] = 1
        stack.append(p)
        for q in sorted(edges.get(p, ())):
            if state.get(q) == 1:
                cycle = stack[stack.index(q):] + [q]
                problems.append("cycle: " + " -> ".join(cycle))
            elif q not in state:
                visit(q, stack)
        stack.pop()
        state[p] = 2

    for p in packages:
        if p not in state:
            visit(p, [])
    return problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", help="query output to read instead")
    args = ap.parse_args()
    if args.graph:
        with open(args.graph) as f:
            text = f.read()
    else:
        # One label per node (no factoring), names never cut short.
        r = subprocess.run(["bazel", "query", QUERY, "--output=graph",
                            "--nograph:factored", "--graph:node_limit=-1"],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            print("failing: bazel query of the package graph")
            print("0 passed, 1 failed")
            return 1
        text = r.stdout
    edges = package_edges(text)
    problems = check(edges)
    n = len(set(edges) | {b for v in edges.values() for b in v})
    for p in problems:
        print("layering:", p)
    if problems:
        print("failing: the package graph (devtools/layering.py)")
        print("0 passed, 1 failed")
        return 1
    print(f"layering: {n} packages, no cycle, no edge upward or sideways")
    print("1 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
