#!/usr/bin/env bash
# Runs a test under ThreadSanitizer (as `--run_under` in tools/dev.sh's
# tsan stage) and runs it again, at most twice, when it failed only on
# reports that bazel/tsan_triage.py finds to be gRPC's own: races between
# two threads gRPC started, with no frame of Ferry's in either access,
# which TSan reports because Debian's gRPC and libstdc++ are not
# instrumented. Any other failure, or a report with a Ferry frame, is the
# test's verdict as it stands. Each run's log goes to the test's output.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log="$(mktemp "${TEST_TMPDIR:-/tmp}/tsan_run.XXXXXX")"
trap 'rm -f "$log"' EXIT
for attempt in 1 2 3; do
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  ((rc == 0)) && exit 0
  grep -q '^WARNING: ThreadSanitizer:' "$log" || exit "$rc"
  /usr/bin/python3 "$here/tsan_triage.py" "$log" || exit "$rc"
  echo "tsan_retry: run $attempt failed only on gRPC's own reports" \
    "(docs/developer-notes.md); running the test again"
done
exit "$rc"
