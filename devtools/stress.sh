#!/usr/bin/env bash
# The whole test suite N times (default 20) while a parallel build keeps
# both cores busy: the check that no test is flaky under load (issue 9,
# docs/reliability.md records the last result).
#   devtools/stress.sh [runs] [extra bazel test flags...]
# The suite runs one pass at a time, and each pass is a line in a ledger
# ($FERRY_STRESS_LEDGER, default ~/.cache/ferry-stress.ledger) keyed by the
# tree under test (every tracked file but Markdown, uncommitted changes
# included). Twenty passes take hours on 2 cores, so a stopped run resumes:
# the script runs only the passes the ledger lacks for this tree, then
# sums every pass of it. With runs=0 it only prints that sum.
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
ledger="${FERRY_STRESS_LEDGER:-$HOME/.cache/ferry-stress.ledger}"
mkdir -p "$(dirname "$ledger")"
touch "$ledger"
tree="$({ git ls-files -s | grep -v '\.md$'; git diff HEAD -- ':!*.md'; } |
  sha1sum | cut -c1-12)"
done_passes() { grep -c "^$tree " "$ledger" || true; }
ci_dir=""
load_pid=""
if (($(done_passes) < runs)) && [[ "${STRESS_LOAD:-build}" == ci ]]; then
  ci_dir="$(mktemp -d /tmp/ferry-stress-ci.XXXXXX)"
  git clone -q . "$ci_dir/ferry"
  mkdir -p "$ci_dir/home"
fi
(($(done_passes) < runs)) && (
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
(($(done_passes) < runs)) && load_pid=$!
cleanup() {
  [[ -n "$load_pid" ]] || return 0
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
rc=0
while (($(done_passes) < runs && stop == 0)); do
  pass=$(($(done_passes) + 1))
  echo "=== pass $pass of $runs (tree $tree, commit $(git rev-parse --short HEAD))"
  t0=$(date +%s)
  bazel test --nocache_test_results "$@" //... 2>&1 | tee "$out"
  status=${PIPESTATUS[0]}
  ((stop == 0)) || break # interrupted: the pass is not recorded
  executed="$(grep -E '^Executed [0-9]+ out of' "$out" | tail -1)"
  targets="$(sed -E 's/^Executed [0-9]+ out of ([0-9]+) tests?:.*/\1/' <<<"$executed")"
  failing="$(grep -E '^//[^ ]+ +(FAILED|TIMEOUT|FLAKY|NO STATUS)' "$out" |
    awk '{print $1 ":" $2}' | paste -sd, -)"
  nfail=0
  [[ -z "$failing" ]] || nfail=$(tr ',' '\n' <<<"$failing" | wc -l)
  if [[ -z "$targets" ]]; then
    targets=0
    failing="${failing:+$failing,}no-summary(exit $status)"
    nfail=$((nfail + 1))
  fi
  echo "$tree pass=$pass targets=$targets failed=$nfail seconds=$(($(date +%s) - t0)) load=$(cut -d' ' -f1 /proc/loadavg) commit=$(git rev-parse --short HEAD) date=$(date -u +%FT%TZ) failing=${failing:--}" >>"$ledger"
  ((nfail == 0)) || rc=1
done
if [[ -n "$ci_dir" ]]; then
  # The CI load runs to its end (bounded), for its stage times.
  for ((i = 0; i < 720; ++i)); do
    grep -q "^exit " "$ci_dir/ci.log" 2>/dev/null && break
    sleep 10
  done
fi
echo "=== this call: $(($(date +%s) - start)) s, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "=== ledger $ledger, tree $tree:"
grep "^$tree " "$ledger" | cut -d' ' -f2-
awk -v t="$tree" '$1 == t {
    n++; for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
    runs += v["targets"]; failed += v["failed"]; secs += v["seconds"]
  } END { printf "=== %d passes of the suite, %d target runs, %d failed, %d s\n", n, runs, failed, secs }' "$ledger"
if grep "^$tree " "$ledger" | grep -qv "failing=-$"; then rc=1; fi
if [[ -n "$ci_dir" ]]; then
  echo "=== CI from a cold cache, run as the load ($ci_dir/ci.log):"
  grep -E "^=== .*: [0-9]+ s$|passed, [0-9]+ failed$|^exit " "$ci_dir/ci.log"
fi
rm -f "$out"
exit $rc
