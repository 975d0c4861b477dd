#!/usr/bin/env bash
# softgpu's library exports exactly the entry points gpu/cuda_abi.h lists
# (the symbol name commented after each PFN_ typedef), nothing more, and
# calls itself libcuda.so.1 (its soname), as NVIDIA's driver does.
#   exports_test.sh LIBCUDA CUDA_ABI_H
set -euo pipefail
lib="$1"
header="$2"
want="$(grep -oE '// (NOLINT )?cu[A-Za-z0-9_]+$' "$header" | awk '{print $NF}' | sort)"
have="$(nm -D --defined-only "$lib" | awk '{print $3}' | sort)"
if [[ "$want" != "$have" ]]; then
  echo "exports differ from gpu/cuda_abi.h (< header, > library):" >&2
  diff <(echo "$want") <(echo "$have") >&2 || true
  exit 1
fi
count="$(wc -l <<<"$want")"
if ((count != 32)); then
  echo "expected the header's 32 entry points, found $count" >&2
  exit 1
fi
soname="$(readelf -d "$lib")"
if [[ "$soname" != *"Library soname: [libcuda.so.1]"* ]]; then
  echo "soname is not libcuda.so.1" >&2
  exit 1
fi
echo "exports: the $count entry points of gpu/cuda_abi.h"
