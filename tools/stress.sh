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
# no disk cache, so every round compiles). With STRESS_LOAD=ci the load
# begins with CI itself (.ci/run) on a clean clone of HEAD with an empty
# HOME, so from a cold build cache: its stage times, printed at the end,
# are then an upper bound of a cold CI run on this machine.
ci_dir=""
if [[ "${STRESS_LOAD:-build}" == ci ]]; then
  ci_dir="$(mktemp -d /tmp/ferry-stress-ci.XXXXXX)"
  git clone -q . "$ci_dir/ferry"
  mkdir -p "$ci_dir/home"
fi
(
  if [[ -n "$ci_dir" ]]; then
    (cd "$ci_dir/ferry" && HOME="$ci_dir/home" bash .ci/run >"$ci_dir/ci.log" 2>&1)
    echo "exit $?" >>"$ci_dir/ci.log"
  fi
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
  if [[ -n "$ci_dir" ]]; then
    pkill -f -- "$ci_dir/home" 2>/dev/null
  fi
}
trap cleanup EXIT

start=$(date +%s)
out="$(mktemp)"
bazel test --runs_per_test="$runs" "$@" //... 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
if [[ -n "$ci_dir" ]]; then
  # The CI load runs to its end (bounded), for its stage times.
  for ((i = 0; i < 720; ++i)); do
    grep -q "^exit " "$ci_dir/ci.log" 2>/dev/null && break
    sleep 10
  done
fi
echo "=== $runs runs per test under load, $(($(date +%s) - start)) s, load average $(cut -d' ' -f1-3 /proc/loadavg)"
grep -E "^Executed|FAILED|flaky|TIMEOUT" "$out" | tail -20
if [[ -n "$ci_dir" ]]; then
  echo "=== CI from a cold cache, run as the load ($ci_dir/ci.log):"
  grep -E "^=== .*: [0-9]+ s$|passed, [0-9]+ failed$|^exit " "$ci_dir/ci.log"
fi
rm -f "$out"
exit $rc
