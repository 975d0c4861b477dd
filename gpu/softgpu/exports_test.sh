#!/usr/bin/env bash
# softgpu's library exports exactly the entry points gpu/cuda_abi.h lists
# (the symbol name commented after each PFN_ typedef) and the test control
# softgpu_control.h declares (softgpu_*, not NVIDIA's), nothing more, and
# calls itself libcuda.so.1 (its soname), as NVIDIA's driver does.
#   exports_test.sh LIBCUDA CUDA_ABI_H SOFTGPU_CONTROL_H
set -euo pipefail
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
  echo "versioned exports (NVIDIA's are unversioned):" >&2
  grep '@' <<<"$all" >&2
  exit 1
fi
have="$(grep -v '^softgpu_' <<<"$all")"
have_control="$(grep '^softgpu_' <<<"$all" || true)"
if [[ -z "$want_control" || "$want_control" != "$have_control" ]]; then
  echo "control exports differ from softgpu_control.h (< header, > library):" >&2
  diff <(echo "$want_control") <(echo "$have_control") >&2 || true
  exit 1
fi
if [[ "$want" != "$have" ]]; then
  echo "exports differ from gpu/cuda_abi.h (< header, > library):" >&2
  diff <(echo "$want") <(echo "$have") >&2 || true
  exit 1
fi
count="$(wc -l <<<"$want")"
if ((count != 33)); then
  echo "expected the header's 33 entry points, found $count" >&2
  exit 1
fi
soname="$(readelf -d "$lib")"
if [[ "$soname" != *"Library soname: [libcuda.so.1]"* ]]; then
  echo "soname is not libcuda.so.1" >&2
  exit 1
fi
echo "exports: the $count entry points of gpu/cuda_abi.h and" \
  "$(wc -l <<<"$want_control") of softgpu_control.h"
