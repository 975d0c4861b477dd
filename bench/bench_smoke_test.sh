#!/bin/bash
# Runs the benchmarks the performance and optimisation chapters cite
# (docs/performance.md, docs/optimisation.md) once, briefly, as a reader
# would rerun them: bench/bench_perftest.sh (Debian's perftest against
# transfer_bench on softrnic, two processes) and bench/bench_striping.sh
# (two namespaced hosts, one NIC against two; needs root) and
# bench/bench_same_host.sh (shm against loopback TCP and RDMA). Each must exit 0
# and print every result line with positive numbers (no nan, nothing
# missing). No timing is checked: CI machines are shared.
# Prints "N passed, N failed".
set -u
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
# The scripts take the binaries from the runfiles instead of bazel.
export OPT_NO_BUILD=1 OPT_BIN="$RUNFILES"
# A number with a nonzero digit: "0.0192", "4.9321", "1.646".
NUM='([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]*\.[0-9]*[1-9][0-9]*)'
check_results() {  # name, the patterns each one line must match, --, the command
  local name="$1" res=() re out
  shift
  while [[ "$1" != -- ]]; do res+=("$1"); shift; done
  shift
  out="$(timeout 120 "$@" 2>&1)"
  local rc=$?
  echo "$out" | tail -5
  local missing=()
  for re in "${res[@]}"; do
    [[ $(grep -cE "$re" <<<"$out") == 1 ]] || missing+=("$re")
  done
  if ((rc == 0 && ${#missing[@]} == 0)) && ! grep -qiw "nan" <<<"$out"; then
    pass "$name"
  else
    # The whole output (bounded): the tail above may not show the cause.
    echo "$out" | head -30 | sed 's/^/  | /'
    ((${#missing[@]} == 0)) || printf '  no line matching: %s\n' "${missing[@]}"
    fail "$name (exit $rc, ${#missing[@]} of ${#res[@]} result lines missing or not numeric)"
  fi
}

# Under --config=asan softrnic is instrumented and Debian's perftest is
# not: the ASan runtime must be loaded first (as perftest_test does).
source "$RUNFILES/transport/softrnic/asan_env.sh"
softrnic_asan_env "$RUNFILES/transport/softrnic"
preload=(env "${asan_env[@]}")
# 1 s samples, 1 round: a round line and a median line per operation.
check_results "bench_perftest.sh: 1 s, 1 round" \
  "^round 1: ib_write_bw $NUM  transfer_bench write $NUM  ib_read_bw $NUM  transfer_bench read $NUM GB/s$" \
  "^median write, 1 MiB: ib_write_bw $NUM GB/s \(range .*\), transfer_bench $NUM GB/s \(range .*\); ratio engine/perftest $NUM$" \
  "^median read, 1 MiB: ib_read_bw $NUM GB/s \(range .*\), transfer_bench $NUM GB/s \(range .*\); ratio engine/perftest $NUM$" \
  -- "${preload[@]}" "$RUNFILES/bench/bench_perftest.sh" 1 1

# The same-host path against loopback TCP and softrnic: one cell, 1 round
# of 1 s samples; a round line and the cell's summary row.
CELLS="write:65536" check_results "bench_same_host.sh: 1 cell, 1 s" \
  "^round 1 write 65536: .*shm $NUM GB/s .*; memcpy $NUM GB/s$" \
  "^write:65536 \| $NUM \(.*\) \| $NUM \(.*\) \| $NUM \(.*\) \| $NUM \(.*\) \| $NUM \| $NUM \| $NUM \| $NUM, $NUM, $NUM$" \
  -- env CELLS="write:65536" "$RUNFILES/bench/bench_same_host.sh" 1 1

# Namespaces and tc need root, as netns_test: CI runs as root. Not being
# root is a failure, not a skip, so a CI change cannot silently drop it.
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "bench_striping.sh needs root and iproute2 (ip netns, tc); run this test as root"
  fail "bench_striping.sh: not run"
else
  # The default rate, 2 s samples (after the script's own 3 s warm-up).
  check_results "bench_striping.sh: 200mbit, 2 s" \
    "^one NIC per host:  $NUM GB/s$" \
    "^two NICs per host: $NUM GB/s$" \
    "^ratio two/one: $NUM$" \
    -- "$RUNFILES/bench/bench_striping.sh" 200mbit 2
fi
finish
