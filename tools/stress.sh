#!/usr/bin/env bash
# The whole test suite N times (default 20) while a parallel build keeps
# both cores busy: the check that no test is flaky under load (issue 9,
# docs/reliability.md records the last result).
#   tools/stress.sh [runs] [extra bazel test flags...]
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:-20}"
shift || true
load_base="${HOME}/.cache/ferry-bazel-stress-load"
stop=0
trap 'stop=1' INT TERM

# The load: a clang build of everything, from scratch, over and over (in
# its own output base, so it never shares the test run's server, and with
# no disk cache, so every round compiles).
(
  while ((stop == 0)); do
    bazel --output_base="$load_base" clean >/dev/null 2>&1
    bazel --output_base="$load_base" build --config=clang --jobs=2 -k \
      --disk_cache= //... \
      >/dev/null 2>&1 || true
  done
) &
load_pid=$!
cleanup() {
  kill "$load_pid" 2>/dev/null
  pkill -f -- "--output_base=$load_base" 2>/dev/null
  bazel --output_base="$load_base" shutdown >/dev/null 2>&1
  wait "$load_pid" 2>/dev/null
}
trap cleanup EXIT

start=$(date +%s)
out="$(mktemp)"
bazel test --runs_per_test="$runs" "$@" //... 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
echo "=== $runs runs per test under load, $(($(date +%s) - start)) s, load average $(cut -d' ' -f1-3 /proc/loadavg)"
grep -E "^Executed|FAILED|flaky|TIMEOUT" "$out" | tail -20
rm -f "$out"
exit $rc
