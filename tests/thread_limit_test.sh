#!/bin/bash
# Issue 26, failure 12: under a thread limit (a container's pids limit),
# start-up aborted -- an uncaught std::system_error -- instead of failing
# with an error. Here transfer_bench (two engines, an embedded metadata
# service, the TCP transport and its own initiator threads) runs under
# RLIMIT_NPROC from 12 threads up, as a user of its own (root is exempt).
# Each run must either transfer or end with exit 1 and a message that
# names what it could not start; a signal (an abort) or a timeout fails.
# Below 12, gRPC 1.51 aborts in its own thread pool (worker->created())
# before Ferry gets a say: documented in docs/reliability.md, not tested.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
bench="$RUNFILES/tools/transfer_bench"

uid=$((230000 + $$ % 20000))
if ! setpriv --reuid="$uid" --regid="$uid" --clear-groups true 2>/dev/null; then
  echo "SKIP: cannot run as another user here (not root?)"
  echo "0 passed, 0 failed"
  exit 0
fi
ran=0 refused=0
for n in 12 14 16 19 22 24 28 32 40 48; do
  log="$tmp/limit-$n.log"
  # A user of its own per run: RLIMIT_NPROC counts the user's threads on
  # the whole machine.
  prlimit --nproc="$n" setpriv --reuid="$((uid + n))" \
    --regid="$((uid + n))" --clear-groups \
    "$bench" --mode=local --listen_host=127.0.0.1 --duration=0.2 \
    --buffer_size=8388608 --threads=4 --block_size=4096 --batch_size=8 \
    >"$log" 2>&1 &
  pid=$!
  pids+=("$pid")
  # A run takes well under a second; one still there after 15 s hangs:
  # its threads' stacks go to the log (gdb, where there is one).
  for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    if command -v gdb >/dev/null; then
      timeout 60 gdb -p "$pid" -batch -ex "thread apply all bt 30" \
        >>"$log" 2>&1
    fi
    kill -9 "$pid"
  fi
  wait "$pid"
  rc=$?
  if ((rc == 0)) && grep -q "transfers/s" "$log"; then
    ran=$((ran + 1))
    pass "$n threads: ran"
  elif ((rc == 1)) && grep -qE "RESOURCE_EXHAUSTED|cannot start" "$log" &&
    ! grep -q "terminate called" "$log"; then
    refused=$((refused + 1))
    pass "$n threads: refused cleanly ($(grep -m1 -oE 'cannot start[^:]*' "$log"))"
  else
    fail "$n threads: exit $rc, neither a run nor a clean refusal" "$log"
  fi
done
# Both outcomes were seen: the limits bound, and enough threads run.
((ran > 0)) && pass "some limit was enough to run" ||
  fail "no limit up to 48 threads was enough to run"
((refused > 0)) && pass "some limit refused cleanly" ||
  fail "no limit refused: the test did not bind"
finish
