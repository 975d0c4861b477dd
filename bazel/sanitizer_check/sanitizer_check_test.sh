#!/bin/bash
# Under --config=sanitize (ASan and UBSan in one build, as CI runs the
# suite) each sanitizer still catches its own kind of bug: a heap overflow
# must end in an AddressSanitizer report, a signed overflow in a UBSan
# runtime error, and neither must run on. In other builds only the clean
# run is checked (the planted bugs are undefined behaviour there).
#   sanitizer_check_test.sh sanitize|plain
set -uo pipefail
# shellcheck source=../../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
bin="$RUNFILES/bazel/sanitizer_check/planted_bugs"
out="$tmp/planted.out"

expect() {  # label, pattern in the output, then the bug's arguments
  local label=$1 pattern=$2
  shift 2
  timeout 60 "$bin" "$@" >"$out" 2>&1
  local rc=$?
  if ((rc == 0)) || ! grep -q "$pattern" "$out" || grep -q "not caught" "$out"; then
    fail "$label (exit $rc, wanted a report matching '$pattern')" "$out"
  else
    pass "$label ($(grep -m1 "$pattern" "$out"))"
  fi
}

timeout 60 "$bin" none 8 >"$out" 2>&1 || abort "the clean run failed" "$out"
pass "clean run"
if [[ "${1:-plain}" == sanitize ]]; then
  expect "ASan catches a heap overflow" \
    "AddressSanitizer: heap-buffer-overflow" heap-overflow 8
  expect "UBSan catches a signed overflow" \
    "runtime error: signed integer overflow" signed-overflow 1
else
  echo "not a --config=sanitize build: planted bugs not run"
fi
finish
