# The library every shell test sources (first, after its `set` line,
# usually `set -uo pipefail`). Gives
#   RUNFILES, tmp           where the built tools are, and a scratch dir
#                           (the test's TEST_TMPDIR; else one of its own,
#                           removed at exit);
#   pids+=($!)              processes SIGKILLed and reaped at exit;
#   at_exit CMD             CMD runs at exit too, once those processes are
#                           killed (the latest first): a test's own
#                           clean-up;
#   pass MSG / fail MSG [LOG...]   count results (fail shows the logs' tails);
#   check NAME CMD...       pass NAME if CMD exits 0, else fail it with the
#                           tail of CMD's output;
#   abort MSG [LOG...]      fail MSG, then finish and exit: a test that
#                           cannot go on (not root, nothing started);
#   free_port               a TCP port nothing is bound to now;
#   wait_for FILE TEXT [PID]  up to 30 s for TEXT to appear in FILE (less
#                           if process PID ends first);
#   finish                  prints "N passed, N failed" and sets the status.
RUNFILES="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}"
_test_lib_tmp=""
if [[ -n "${TEST_TMPDIR:-}" ]]; then
  tmp="$TEST_TMPDIR"
else
  tmp="$(mktemp -d)"
  _test_lib_tmp="$tmp"
fi
pids=()
_test_lib_at_exit=()
_test_lib_cleanup() {
  local p i
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  # Reaped at once, so that bash does not report each as killed.
  ((${#pids[@]} == 0)) || wait "${pids[@]}" 2>/dev/null || true
  for ((i = ${#_test_lib_at_exit[@]} - 1; i >= 0; i--)); do
    eval "${_test_lib_at_exit[$i]}"
  done
  # Then any other child, once the hooks have ended what they own.
  wait 2>/dev/null
  [[ -z "$_test_lib_tmp" ]] || rm -rf "$_test_lib_tmp"
}
trap _test_lib_cleanup EXIT
at_exit() { _test_lib_at_exit+=("$1"); }
passed=0 failed=0
pass() { echo "PASS: $1"; passed=$((passed + 1)); }
fail() {
  echo "FAIL: $1"
  shift
  (($# == 0)) || tail -n 20 "$@"
  failed=$((failed + 1))
}
check() {  # name, then the command
  local name="$1"
  shift
  if "$@" >"$tmp/check.out" 2>&1; then
    pass "$name"
  else
    fail "$name" "$tmp/check.out"
  fi
}
abort() {  # message, then logs
  fail "$@"
  finish
  exit 1
}
# free_port (and listening, wait_listening).
# shellcheck source=ports.sh
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
