#!/bin/bash
# Runs storm_bench briefly in its in-process shapes, as docs/performance.md
# runs it at scale: a storm of initiators on one target over tcp and over
# rdma (softrnic), and all-to-all over tcp. Each must end with no failure
# and a JSON report with every field the docs quote. No timing is checked:
# CI machines are shared (bench/bench_storm.sh, across namespaced hosts,
# is the benchmark).
set -u
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
storm="$RUNFILES/bench/storm_bench"
export FERRY_LOG_LEVEL=warn
check_report() {  # name, then the command
  local name="$1" out rc
  shift
  out="$(timeout 120 "$@" 2>"$tmp/err")"
  rc=$?
  if ((rc == 0)) && python3 - "$out" <<'PY'; then
import json, sys
r = json.loads(sys.argv[1].strip().splitlines()[-1])
for k in ("p50_s", "p99_s", "max_s", "failures", "handshake_rpcs", "qps"):
    assert k in r, k
assert r["failures"] == 0 and 0 < r["p50_s"] <= r["p99_s"] <= r["max_s"], r
assert r["handshake_rpcs"] >= r["engines"], r
assert r["protocol"] != "rdma" or r["qps"] >= 2 * r["engines"], r
PY
    pass "$name: $out"
  else
    fail "$name (exit $rc): $out" "$tmp/err"
  fi
}
check_report "tcp storm of 32" "$storm" --initiators=32 --report=json
check_report "tcp all-to-all of 8" "$storm" --all_to_all=8 --report=json
# On softrnic's libibverbs.so.1, built with (and instrumented like) the
# benchmark.
check_report "rdma storm of 16" env FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 \
  LD_LIBRARY_PATH="$RUNFILES/transport/softrnic" "$storm" --protocol=rdma \
  --initiators=16 --report=json
finish
