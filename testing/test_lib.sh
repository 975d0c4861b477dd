# Shared by the shell tests that run Ferry's real processes: source it
# after `set -uo pipefail`. Gives
#   RUNFILES, tmp           where the built tools are, and a scratch dir;
#   pids+=($!)              processes SIGKILLed and reaped at exit;
#   pass MSG / fail MSG [LOG...]   count results (fail shows the logs' tails);
#   free_port               a TCP port nothing is bound to now;
#   wait_for FILE TEXT [PID]  up to 30 s for TEXT to appear in FILE (less
#                           if process PID ends first);
#   finish                  prints "N passed, N failed" and sets the status.
RUNFILES="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
pids=()
_test_lib_cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
}
trap _test_lib_cleanup EXIT
passed=0 failed=0
pass() { echo "PASS: $1"; passed=$((passed + 1)); }
fail() { echo "FAIL: $1"; shift; tail -n 20 "$@"; failed=$((failed + 1)); }
# free_port (and listening, wait_listening).
source "$RUNFILES/testing/ports.sh"
wait_for() {
  # Up to 30 s: under ASan on a loaded machine a start takes seconds.
  local _
  for _ in $(seq 300); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    [[ -n "${3:-}" ]] && ! kill -0 "$3" 2>/dev/null && break
    sleep 0.1
  done
  grep -q "$2" "$1" 2>/dev/null  # It may have logged it, then ended.
}
finish() {
  echo "$passed passed, $failed failed"
  ((failed == 0))
}
