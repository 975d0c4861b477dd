# Sourced by tests that run programs built outside this repository (Debian's
# ibverbs-utils, perftest) on softrnic. Under an ASan config softrnic's
# libibverbs.so.1 is instrumented and those programs are not: the ASan
# runtime must then be preloaded so it comes first (gcc's, which the
# library names; or clang's shared one, where the library leaves the
# runtime's symbols undefined). Leak checking is for Ferry's code, not
# theirs, so it is off.
#   softrnic_asan_env DIR   (DIR holds softrnic's libibverbs.so.1)
# sets the array asan_env to the NAME=VALUE words that does (empty when
# softrnic is not instrumented), for `export` or `env`.
softrnic_asan_env() {
  local rt
  rt="$(ldd "$1/libibverbs.so.1" | awk '/libasan/ {print $3}')"
  if [[ -z "$rt" ]] &&
    [[ "$(nm -D --undefined-only "$1/libibverbs.so.1")" == *__asan_init* ]]; then
    rt="$(clang -print-runtime-dir)/libclang_rt.asan-x86_64.so"
  fi
  asan_env=()
  if [[ -n "$rt" ]]; then
    asan_env=("LD_PRELOAD=$rt" "ASAN_OPTIONS=detect_leaks=0:abort_on_error=1")
  fi
}
