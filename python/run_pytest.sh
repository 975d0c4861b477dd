#!/bin/bash
# Runs python/tests with Debian's python3 against the package as Bazel built
# it: ferry/*.py and _ferry.so copied into a fresh directory on PYTHONPATH.
# Under the sanitizers the extension needs their runtimes loaded first
# (python3 itself is not instrumented).
set -euo pipefail
runfiles="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}"
pkg="$(mktemp -d "${TEST_TMPDIR:-/tmp}/ferrypy.XXXXXX")"
trap 'rm -rf "$pkg"' EXIT
mkdir -p "$pkg/ferry"
cp "$runfiles"/python/ferry/*.py "$pkg/ferry/"
cp "$runfiles/python/_ferry.so" "$pkg/ferry/"
# The opt-in `mooncake` alias, as tools/dev.sh python --as-mooncake
# installs it: the tests import mooncake.engine as SGLang and vLLM do.
mkdir -p "$pkg/mooncake"
cp "$runfiles"/python/mooncake/*.py "$pkg/mooncake/"
# shellcheck source=../bazel/sanitizer_preload.sh
source "$runfiles/bazel/sanitizer_preload.sh"
preload="$(sanitizer_preload "$pkg/ferry/_ferry.so")"
export ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0"
cd "$pkg"
# softrnic's libibverbs: the RDMA parts (topology) find soft NICs; and
# softgpu's libcuda.so.1, two emulated GPUs (tests/test_gpu.py).
export FERRY_SOFTGPU_DEVICES=2
LD_LIBRARY_PATH="$runfiles/transport/softrnic:$runfiles/gpu/softgpu" \
  LD_PRELOAD="$preload" \
  PYTHONPATH="$pkg" timeout 300 /usr/bin/python3 -m pytest \
    -q -p no:cacheprovider "$runfiles/python/tests"
