#!/bin/bash
# Runs the optimisation chapter's A/B scripts (docs/optimisation.md) once,
# briefly, as a reader would rerun them: bench/opt_bench.sh (transfer_bench
# on softrnic, two processes) and bench/opt_perftest.sh (Debian's perftest
# on softrnic). Each must print a numeric median for every variant. No
# timing is checked: CI machines are shared.
set -u
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
export OPT_NO_BUILD=1 OPT_BIN="$RUNFILES"
check_medians() {  # name, then the command
  local name="$1" out
  shift
  out="$(timeout 120 "$@" 2>&1)"
  local rc=$?
  echo "$out" | tail -4
  local medians
  medians="$(grep -cE '^variant \[[0-9]+\] .*: median [0-9.]+[0-9] ' <<<"$out")"
  if ((rc == 0 && medians == 2)) && ! grep -q "nan" <<<"$out"; then
    pass "$name"
  else
    fail "$name (exit $rc, $medians numeric medians of 2); its output:"
    # The whole output (bounded): the tail above may not show the cause.
    head -c 20000 <<<"$out"
  fi
}
OPT_FLAGS="--operation=write --block_size=65536 --threads=1 --duration=1 --warmup=0" \
  check_medians "opt_bench.sh: batch 1 against 16" \
  "$RUNFILES/bench/opt_bench.sh" -r 1 "--batch_size=1" "--batch_size=16"
# Under --config=asan softrnic is instrumented and Debian's perftest is
# not: the ASan runtime must be loaded first (as perftest_test does).
source "$RUNFILES/transport/softrnic/asan_env.sh"
softrnic_asan_env "$RUNFILES/transport/softrnic"
preload=(env "${asan_env[@]}")
check_medians "opt_perftest.sh: inline 0 against 64" \
  "${preload[@]}" "$RUNFILES/bench/opt_perftest.sh" -r 1 -m rate ib_write_bw \
  "-s 64 -D 1 -I 0" "-s 64 -D 1 -I 64"
finish
