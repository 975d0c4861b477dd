#!/bin/bash
# Smoke test of a Google Benchmark binary: runs every benchmark in it
# briefly (no timing is checked: CI machines are shared) and fails unless
# the binary exits 0, each expected benchmark reported a result, and none
# reported an error (each checks its own results and calls SkipWithError on
# a wrong one). Usage: benchmark_smoke_test.sh BINARY NAME...
# A NAME is a full benchmark name as printed, e.g. BM_SieveCacheFind/64.
# --verbs=LIB first: run it on that libibverbs.so.1 (softrnic's), found
# before the system's.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"

if [[ "${1:-}" == --verbs=* ]]; then
  lib="${1#--verbs=}"
  LD_LIBRARY_PATH="$(cd "$(dirname "$lib")" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
  shift
fi
bin="$1"
shift
out="$tmp/benchmark.out"
# Debian 12's Google Benchmark is 1.7.1: min_time is plain seconds.
"$bin" --benchmark_min_time=0.01 --benchmark_color=false >"$out" 2>&1
rc=$?
cat "$out"
if ((rc == 0)); then pass "$bin exited 0"; else fail "$bin exited with $rc"; fi
if grep -q "ERROR OCCURRED" "$out"; then
  fail "a benchmark reported an error: $(grep "ERROR OCCURRED" "$out")"
else
  pass "no benchmark reported an error"
fi
for name in "$@"; do
  # A result line: the name, spaces, then the time.
  if grep -Eq "^${name}[[:space:]]+[0-9]" "$out"; then
    pass "a result for $name"
  else
    fail "no result for $name"
  fi
done
finish
