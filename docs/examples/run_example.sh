#!/bin/bash
# Runs a docs example (its arguments follow) and fails if it exits non-zero
# or prints nothing. With FERRY_SOFTRNIC_LIB (a runfiles-relative folder)
# the example runs on softrnic's libibverbs.so.1.
set -euo pipefail
if [[ -n "${FERRY_SOFTRNIC_LIB:-}" ]]; then
  export LD_LIBRARY_PATH="${TEST_SRCDIR}/${TEST_WORKSPACE}/${FERRY_SOFTRNIC_LIB}"
  export FERRY_SOFTRNIC_DEVICES="${FERRY_SOFTRNIC_DEVICES:-softrnic0=127.0.0.1}"
fi
out="$("$@")"
echo "$out"
[[ -n "$out" ]]
