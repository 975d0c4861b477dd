#!/bin/bash
# bench/matrix end to end: the quick profile on namespaced hosts (4 hosts;
# tcp and rdma, READ and WRITE, two block sizes, 3 -> 1; iperf3, ucx_perftest
# and memcpy references), then the smoke profile over a host list with the
# netns launcher (namespaces standing in for ssh/srun hosts). Checks what
# it writes: results.jsonl (machine info, every point with its rounds,
# median and range), ratios.md, summary.md and the PNG plots; --report
# rebuilds the reports from the results. Needs root.
# Prints "N passed, N failed".
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
[[ $(id -u) -eq 0 ]] || abort "bench_test needs root (ip netns)"
# shellcheck disable=SC2016  # Expanded at exit.
at_exit '"$RUNFILES/tools/cluster" clean 2>/dev/null'

# The content of an output directory: $1 dir, $2 the expected points as a
# Python expression over rows (list of dicts), $3 the plots.
check_out() {
  /usr/bin/python3 - "$@" <<'PY'
import json, re, sys
d, expect, plots = sys.argv[1], sys.argv[2], sys.argv[3].split()
rows = [json.loads(l) for l in open(f"{d}/results.jsonl")]
meta = rows[0]
assert meta["kind"] == "meta" and meta["cores"] > 0 and meta["kernel"], meta
ferry = [r for r in rows if r["kind"] == "ferry"]
for r in rows[1:]:
    assert r["unit"] == "GB/s" and r["rounds"], r
    assert r["min"] <= r["median"] <= r["max"] and r["max"] > 0, r
    assert len(r["rounds"]) == len(rows[1]["rounds"]), r
got = eval(f"({expect})", {"rows": rows, "ferry": ferry})
assert got is True, f"expected points missing: {expect}"
table = [l for l in open(f"{d}/ratios.md") if l.startswith("| ") and "x |" in l]
assert len(table) >= len(ferry), (len(table), len(ferry))
summary = open(f"{d}/summary.md").read()
first = ferry[0]
blocks = {f["block"] for f in ferry if (f["hosts"], f["nics"]) ==
          (first["hosts"], first["nics"])}
rows_md = [l for l in summary.splitlines()
           if re.match(r"^\| \d+ [KM]iB \|", l)]
assert len(rows_md) >= len(blocks), (rows_md, blocks)
assert all("(" in l and "–" in l for l in rows_md), rows_md  # median (min–max)
for p in plots:
    head = open(f"{d}/{p}", "rb").read(8)
    assert head == b"\x89PNG\r\n\x1a\n", (p, head)
print(f"{len(ferry)} Ferry points, {len(rows) - 1 - len(ferry)} references, "
      f"{len(table)} ratios, plots {plots}")
PY
}

# Two rounds of 0.3 s per point, 32 MiB buffers: the harness is under test
# here, not the figures, and two rounds still give a median and a range
# (the buffers were most of the run's time under the sanitizers: every
# point starts initiators that register them).
out1="$tmp/quick"
check "quick profile on 4 namespaced hosts runs end to end" \
  timeout 900 "$RUNFILES/bench/matrix" --profile quick --rounds 2 \
  --seconds 0.3 --buffer-mib 32 --bin "$RUNFILES" --out "$out1"
check "quick profile output: every point, the references, ratios, plots" \
  check_out "$out1" '
len([f for f in ferry if f["initiators"] == 1]) == 2 * 2 * 2 and
{(f["protocol"], f["op"]) for f in ferry} >= {("tcp", "read"), ("tcp", "write"), ("rdma", "read"), ("rdma", "write")} and
{f["protocol"] for f in ferry if f["initiators"] == 3} == {"tcp", "rdma"} and
{r["streams"] for r in rows if r["kind"] == "iperf3"} == {1, 4} and
{r["tls"] for r in rows if r["kind"] == "ucx"} == {"tcp", "sm"} and
len([r for r in rows if r["kind"] == "memcpy"]) == 2 and
all(len(r["rounds"]) == 2 for r in rows[1:])' "tcp.png rdma.png"

# --report writes the reports again from the results alone.
check "--report rebuilds ratios, summary and plots from results.jsonl" \
  bash -c 'rm -f "$1"/ratios.md "$1"/summary.md "$1"/*.png &&
    "$2/bench/matrix" --report --out "$1" && test -s "$1/ratios.md" &&
    test -s "$1/summary.md" && test -s "$1/rdma.png"' _ "$out1" "$RUNFILES"

# Hosts from a list, launched by the netns launcher: the path ssh and srun
# take, with namespaces as the hosts.
out2="$tmp/hostlist"
check "smoke profile over a host list (netns launcher)" \
  timeout 300 "$RUNFILES/tools/cluster" --bin "$RUNFILES" --hosts 2 -- \
  bash -c 'source "$CLUSTER_ENV"
    for i in 1 2; do
      ip="CLUSTER_IP_${i}_1" dev="CLUSTER_DEVICES_$i"
      echo "${CLUSTER_TAG}h$i ${!ip} ${!dev}"
    done >"'"$tmp"'/hosts"
    "'"$RUNFILES"'/bench/matrix" --profile smoke --hosts-file "'"$tmp"'/hosts" \
      --launcher netns --buffer-mib 32 --bin "'"$RUNFILES"'" --out "'"$out2"'"'
check "host-list output" check_out "$out2" '
len(ferry) == 1 and ferry[0]["protocol"] == "tcp"' "tcp.png"

finish
