#!/usr/bin/env bash
# bazel/tsan_triage.py and tsan_retry.sh: a gRPC-internal report is rerun,
# at most twice; one with a Ferry frame, or a thread Ferry started, is
# failed at once.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
dir="$RUNFILES/bazel"

check "gRPC-internal report is gRPC's" \
  /usr/bin/python3 "$dir/tsan_triage.py" "$dir/testdata/tsan_grpc_internal.log"
for f in tsan_ferry_frame tsan_ferry_thread; do
  if /usr/bin/python3 "$dir/tsan_triage.py" "$dir/testdata/$f.log" >/dev/null; then
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
if ((n < FAILS)); then cat "$FIXTURE"; exit 66; fi
echo "test passed"
FAKE
chmod +x "$fake"
run_fake() {  # FIXTURE FAILS -> "rc runs"
  export COUNT="$tmp/count.$RANDOM" FIXTURE="$dir/testdata/$1.log" FAILS="$2"
  "$dir/tsan_retry.sh" "$fake" >"$tmp/out" 2>&1
  echo "$? $(cat "$COUNT")"
}
expect() {  # NAME GOT WANT
  if [[ "$2" == "$3" ]]; then pass "$1"; else fail "$1: got '$2', want '$3'" "$tmp/out"; fi
}
expect "a gRPC-internal failure is run again" "$(run_fake tsan_grpc_internal 1)" "0 2"
expect "at most three runs" "$(run_fake tsan_grpc_internal 5)" "66 3"
expect "a Ferry race fails at once" "$(run_fake tsan_ferry_frame 1)" "66 1"
expect "a race on a Ferry thread fails at once" "$(run_fake tsan_ferry_thread 1)" "66 1"
finish
