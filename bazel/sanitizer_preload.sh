# Sourced by tests that load an instrumented shared object (Ferry's Python
# extension) into an uninstrumented program (Debian's python3).
#   sanitizer_preload SO
# prints the LD_PRELOAD list that lets SO load: the ASan runtime first
# (ASan insists on coming first in the initial library list), the UBSan
# runtime, then libstdc++ (python3 does not link it, and the runtimes'
# __cxa_throw interceptors need the real one loaded when they start).
# Prints nothing for an uninstrumented SO. Works for gcc's asan and ubsan
# configs (SO needs gcc's shared runtimes) and clang's combined sanitize
# config (clang links its runtime into executables only, so SO leaves the
# runtime's symbols undefined; clang's shared ASan runtime has UBSan's
# handlers too).
sanitizer_preload() {
  # Not `ldd | grep -q`: grep quitting early can kill ldd (SIGPIPE) and,
  # with pipefail, skip the preload at random.
  local deps undefined rt list=()
  deps="$(ldd "$1")"
  for rt in asan ubsan; do
    if [[ "$deps" == *"lib${rt}.so"* ]]; then
      list+=("$(gcc -print-file-name="lib${rt}.so")")
    fi
  done
  if ((${#list[@]} == 0)); then
    undefined="$(nm -D --undefined-only "$1")"
    if [[ "$undefined" == *__asan_init* ]]; then
      list+=("$(clang -print-runtime-dir)/libclang_rt.asan-x86_64.so")
    fi
  fi
  if ((${#list[@]} > 0)); then
    list+=("$(gcc -print-file-name=libstdc++.so)")
  fi
  echo "${list[*]}"
}
