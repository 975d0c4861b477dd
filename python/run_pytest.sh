#!/bin/bash
# Runs python/tests with Debian's python3 against the package as Bazel built
# it: ferry/*.py and _ferry.so copied into a fresh directory on PYTHONPATH.
# Under ASan or UBSan the extension needs its sanitizer runtime loaded
# first (python3 itself is not instrumented).
set -euo pipefail
runfiles="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}"
pkg="$(mktemp -d "${TEST_TMPDIR:-/tmp}/ferrypy.XXXXXX")"
trap 'rm -rf "$pkg"' EXIT
mkdir -p "$pkg/ferry"
cp "$runfiles"/python/ferry/*.py "$pkg/ferry/"
cp "$runfiles/python/_ferry.so" "$pkg/ferry/"
preload=""
for rt in asan ubsan; do
  # Not `ldd | grep -q`: grep quitting early can kill ldd (SIGPIPE) and,
  # with pipefail, skip the preload at random.
  if [[ "$(ldd "$pkg/ferry/_ferry.so")" == *"lib${rt}"* ]]; then
    # libstdc++ too: python3 does not link it, and the runtime's
    # __cxa_throw interceptor needs the real one loaded when it starts.
    preload="$(gcc -print-file-name=lib${rt}.so) $(gcc -print-file-name=libstdc++.so)"
  fi
done
export ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0"
cd "$pkg"
# softrnic's libibverbs: the RDMA parts (topology) find soft NICs.
LD_LIBRARY_PATH="$runfiles/transport/softrnic" LD_PRELOAD="$preload" \
  PYTHONPATH="$pkg" timeout 300 /usr/bin/python3 -m pytest \
    -q -p no:cacheprovider "$runfiles/python/tests"
