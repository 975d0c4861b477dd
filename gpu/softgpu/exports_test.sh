#!/usr/bin/env bash
# softgpu's library exports exactly the entry points gpu/cuda_abi.h lists
# (the symbol name commented after each PFN_ typedef) and the test control
# softgpu_control.h declares (softgpu_*, not NVIDIA's), nothing more, and
# calls itself libcuda.so.1 (its soname), as NVIDIA's driver does.
#   exports_test.sh LIBCUDA CUDA_ABI_H SOFTGPU_CONTROL_H
set -uo pipefail
# shellcheck source=../../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
lib="$1"
header="$2"
control="$3"
want="$(grep -oE '// (NOLINT )?cu[A-Za-z0-9_]+$' "$header" | awk '{print $NF}' | sort)"
want_control="$(grep -oE '\(\*softgpu_[a-z_]+_fn\)' "$control" |
  sed -E 's/^\(\*(.*)_fn\)$/\1/' | sort)"
# Names only: nm may append @VERSION, and none may carry one. Exports are
# the global symbols (nm's upper-case types, and u, GNU unique): a local
# one in the dynamic table (the initial-exec TLS variable, for its
# relocation) is no export.
all="$(nm -D --defined-only "$lib" | awk '$2 ~ /^([A-Z]|u)$/ {print $3}' | sort)"
if grep -q '@' <<<"$all"; then
  fail "versioned exports (NVIDIA's are unversioned): $(grep '@' <<<"$all" | tr '\n' ' ')"
else
  pass "no versioned export"
fi
have="$(grep -v '^softgpu_' <<<"$all")"
have_control="$(grep '^softgpu_' <<<"$all" || true)"
if [[ -n "$want_control" && "$want_control" == "$have_control" ]]; then
  pass "$(wc -l <<<"$want_control") control exports, as softgpu_control.h declares"
else
  diff <(echo "$want_control") <(echo "$have_control") >"$tmp/control.diff"
  fail "control exports differ from softgpu_control.h (< header, > library)" "$tmp/control.diff"
fi
if [[ "$want" == "$have" ]]; then
  pass "the entry points of gpu/cuda_abi.h, nothing more"
else
  diff <(echo "$want") <(echo "$have") >"$tmp/exports.diff"
  fail "exports differ from gpu/cuda_abi.h (< header, > library)" "$tmp/exports.diff"
fi
count="$(wc -l <<<"$want")"
if ((count == 37)); then
  pass "the header's 37 entry points"
else
  fail "expected the header's 37 entry points, found $count"
fi
if [[ "$(readelf -d "$lib")" == *"Library soname: [libcuda.so.1]"* ]]; then
  pass "soname libcuda.so.1"
else
  fail "soname is not libcuda.so.1"
fi
finish
