#!/usr/bin/env bash
# bazel/tsan_triage.py and tsan_retry.sh: a gRPC-internal report is rerun,
# at most twice; one with a Ferry frame, or a thread Ferry started, is
# failed at once.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
dir="$RUNFILES/bazel"

for f in tsan_grpc_internal tsan_grpc_named_threads; do
  check "$f is gRPC's" /usr/bin/python3 "$dir/tsan_triage.py" "$dir/testdata/$f.txt"
done
# A Ferry frame in an access; a thread Ferry started; a log line of
# another thread interleaved into the report (and a Ferry frame after it).
for f in tsan_ferry_frame tsan_ferry_thread tsan_interleaved; do
  if /usr/bin/python3 "$dir/tsan_triage.py" "$dir/testdata/$f.txt" >/dev/null; then
    fail "$f is taken for gRPC's own"
  else
    pass "$f is Ferry's"
  fi
done

# A test that fails with FIXTURE's report FAILS times, then passes.
fake="$tmp/fake_test.sh"
cat >"$fake" <<'FAKE'
#!/usr/bin/env bash
n=$(cat "$COUNT" 2>/dev/null || echo 0)
echo $((n + 1)) >"$COUNT"
if ((n < FAILS)); then
  [[ -n "${GTEST_FAIL:-}" ]] && echo "x_test.cc:12: Failure"
  cat "$FIXTURE"
  exit "${RC:-66}"
fi
echo "test passed"
FAKE
chmod +x "$fake"
run_fake() {  # FIXTURE FAILS [RC [GTEST_FAIL]] -> "rc runs"
  export COUNT="$tmp/count.$RANDOM" FIXTURE="$dir/testdata/$1.txt" FAILS="$2"
  export RC="${3:-66}" GTEST_FAIL="${4:-}"
  # The wrapper empties its TEST_TMPDIR between runs: give it its own.
  mkdir -p "$tmp/scratch"
  TEST_TMPDIR="$tmp/scratch" "$dir/tsan_retry.sh" "$fake" >"$tmp/out" 2>&1
  echo "$? $(cat "$COUNT")"
}
expect() {  # NAME GOT WANT
  if [[ "$2" == "$3" ]]; then pass "$1"; else fail "$1: got '$2', want '$3'" "$tmp/out"; fi
}
expect "a gRPC-internal failure is run again" "$(run_fake tsan_grpc_internal 1)" "0 2"
expect "at most three runs" "$(run_fake tsan_grpc_internal 5)" "66 3"
expect "a Ferry race fails at once" "$(run_fake tsan_ferry_frame 1)" "66 1"
expect "a race on a Ferry thread fails at once" "$(run_fake tsan_ferry_thread 1)" "66 1"
expect "another exit code is the test's" "$(run_fake tsan_grpc_internal 1 1)" "1 1"
expect "a test failure before the report stands" \
  "$(run_fake tsan_grpc_internal 1 66 yes)" "66 1"
finish
