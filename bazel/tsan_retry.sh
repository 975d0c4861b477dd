#!/usr/bin/env bash
# Runs a test under ThreadSanitizer (as `--run_under` in tools/dev.sh's
# tsan stage) and runs it again, at most twice, when it failed only on
# reports that bazel/tsan_triage.py finds to be gRPC's own: races between
# two threads gRPC started, with no frame of Ferry's in either access,
# which TSan reports because Debian's gRPC and libstdc++ are not
# instrumented. Only a run that TSan ended (exit 66) with no test failure
# of its own is run again; any other failure, or a report with a Ferry
# frame, is the test's verdict as it stands. Each run's output goes to the
# test's log. (Through tee: a test that left a process holding its output
# would hold the wrapper too, until bazel's timeout.)
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for attempt in 1 2 3; do
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  ((rc == 0)) && exit 0
  ((rc == 66)) || exit "$rc"  # TSan's exit code; anything else is the test's.
  grep -q '^WARNING: ThreadSanitizer:' "$log" || exit "$rc"
  # A gtest failure (or a shell test's FAIL) before the report stands.
  grep -qE '^\[  FAILED  \]|: Failure$|^FAIL: ' "$log" && exit "$rc"
  /usr/bin/python3 "$here/tsan_triage.py" "$log" || exit "$rc"
  echo "tsan_retry: run $attempt failed only on gRPC's own reports" \
    "(docs/reliability.md, \"The checks\"); running the test again"
  # A fresh scratch directory, as bazel gives each run.
  [[ -n "${TEST_TMPDIR:-}" ]] && find "$TEST_TMPDIR" -mindepth 1 -delete 2>/dev/null
done
exit "$rc"
