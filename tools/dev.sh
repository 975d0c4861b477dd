#!/usr/bin/env bash
# Ferry's front door. On a fresh Debian 12 machine:
#   tools/dev.sh demo   # installs what is needed, builds, runs a demo transfer
#   tools/dev.sh test   # installs what is needed, runs the whole test suite
# Other subcommands: setup, build, python (installs the Python package for
# /usr/bin/python3), bench-tcp, format, clang (thread-safety analysis
# alone; CI gets it from `test --config=sanitize`), and the checks CI runs
# besides `test`: wheel, layering, tsan, fuzz.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the demo needs: the build toolchain and the libraries Ferry links
# (the WORKSPACE's system_libs looks up every one of them, test libraries
# included, when Bazel first loads it). etcd's .proto files, which the
# engine's etcd back end is generated from, come separately (etcd_protos).
DEMO_PACKAGES=(
  bazel-bootstrap pkg-config g++ clang
  libibverbs-dev libabsl-dev libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc libgtest-dev libgmock-dev
  libbenchmark-dev libspdlog-dev libssl-dev
)
# What the tests, CI's other stages, the benchmarks and the docs site need
# besides: reference tools, namespaces, clang, etcd, Python, the browser.
TEST_PACKAGES=(
  python3 iperf3 ibverbs-utils perftest iproute2
  clang-format
  libclang-rt-14-dev lld
  etcd-server
  openssl
  python3-dev pybind11-dev python3-pytest python3-numpy
  python3-venv patchelf
  ucx-utils python3-matplotlib
  mkdocs mkdocs-material python3-pymdownx chromium
)

# Installs what is missing of the given packages (all of them when none
# are given): idempotent, and no apt call at all when nothing is missing.
setup() {
  local wanted=("$@")
  ((${#wanted[@]} > 0)) || wanted=("${DEMO_PACKAGES[@]}" "${TEST_PACKAGES[@]}")
  local missing=()
  for p in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" ||
      missing+=("$p")
  done
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  if ((${#missing[@]} > 0)); then
    echo "dev.sh: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get -o DPkg::Lock::Timeout=600 update -q
    $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}"
  fi
  etcd_protos "$sudo"
}

# etcd's .proto files (bazel/etcd_proto.bzl finds them). Debian ships them
# in golang-etcd-server-dev, whose ~130 Go source dependencies took half of
# a fresh machine's set-up; so unless the package is installed, that one
# .deb is fetched from the archive with apt and only its .proto files are
# unpacked, into a directory dpkg does not manage.
ETCD_PROTO_ROOT=/usr/local/share/ferry/etcd-proto
etcd_protos() {
  local sudo="$1"
  local rel=usr/share/gocode/src/go.etcd.io/etcd/etcdserver/etcdserverpb/rpc.proto
  if [[ -f "/$rel" || -f "$ETCD_PROTO_ROOT/$rel" ]]; then return 0; fi
  echo "dev.sh: unpacking etcd's .proto files from golang-etcd-server-dev into $ETCD_PROTO_ROOT" >&2
  local tmp
  tmp="$(mktemp -d)"
  # apt downloads as its own user, _apt, where it may write.
  if [[ $(id -u) -eq 0 ]] && id _apt >/dev/null 2>&1; then chown _apt "$tmp"; fi
  if ! (cd "$tmp" && apt-get download -q golang-etcd-server-dev); then
    # No package lists yet (nothing else was missing, so no update ran).
    $sudo apt-get -o DPkg::Lock::Timeout=600 update -q
    (cd "$tmp" && apt-get download -q golang-etcd-server-dev)
  fi
  $sudo mkdir -p "$ETCD_PROTO_ROOT"
  dpkg-deb --fsys-tarfile "$tmp"/golang-etcd-server-dev_*.deb |
    $sudo tar -x -C "$ETCD_PROTO_ROOT" --wildcards '*.proto'
  rm -rf "$tmp"
  [[ -f "$ETCD_PROTO_ROOT/$rel" ]] ||
    { echo "dev.sh: golang-etcd-server-dev has no $rel" >&2; return 1; }
}

BAZEL=(bazel)
# clang builds (thread-safety analysis, TSan, libFuzzer) reconfigure Bazel's
# C++ toolchain: each gets its own output base, so that switching between
# them and gcc never rebuilds from scratch (a disk cache, if the user set
# one, is shared).
# Bazel names a link to its execroot after this directory (bazel-<dir>);
# the execroot mirrors the source tree, BUILD files and all, so //... would
# load it as packages unless .bazelignore lists it (it lists the usual
# clone names). In a clone under another name the link is dropped before
# each use of //... (a build makes it again; nothing here needs it).
drop_execroot_link() {
  local link="bazel-${PWD##*/}"
  if [[ -L "$link" ]] && ! grep -qx "$link" .bazelignore; then rm -f "$link"; fi
}

clang_bazel() {
  BAZEL=(bazel "--output_base=${HOME}/.cache/ferry-bazel-$1")
}

build() {
  drop_execroot_link
  "${BAZEL[@]}" build -c opt //... "$@"
}

# The demo builds the quick way: clang at -O0, in its own output base.
# On a fresh 2-core machine the build is most of the demo's time, and
# parsing the gRPC, protobuf and abseil headers is most of the build:
# clang parses them faster than gcc, and -O0 skips optimizing generated
# code (0.44x gcc -O2's compile time on six of the demo's heaviest files;
# with the flags below, the demo's cold build went from 158 s to 69 s in a
# fresh chroot). The figures it prints are therefore a debug build's (TCP about
# 0.8x, softrnic RDMA about 0.5x of -c opt); `tools/dev.sh build` and the
# benchmarks (docs/performance.md) build -c opt. It also leaves out the
# etcd back end, which the demo does not use (a tenth of its compile time),
# and builds outside Bazel's sandbox, which a throwaway build does not need.
DEMO_FLAGS=(--config=clang --define=ferry_etcd=0 --spawn_strategy=local)
demo() {
  setup "${DEMO_PACKAGES[@]}"
  clang_bazel demo
  "${BAZEL[@]}" build "${DEMO_FLAGS[@]}" \
    //tools:transfer_bench //transport/softrnic:libibverbs.so.1
  local bin bench
  bin="$("${BAZEL[@]}" info "${DEMO_FLAGS[@]}" bazel-bin 2>/dev/null)"
  bench="$bin/tools/transfer_bench"
  local common=(--mode=local --block_size=1048576 --batch_size=8 --threads=1
    --buffer_size=$((64 << 20)) --duration=1 --verify)
  echo "== Ferry demo: two engines on loopback, embedded metadata service, TCP"
  echo "   (an unoptimized quick build: its rates are not Ferry's performance)"
  echo "-- WRITE 1 MiB blocks, every byte verified (read back and compared)"
  "$bench" "${common[@]}" --operation=write
  echo "-- READ 1 MiB blocks, every byte verified against the target's pattern"
  "$bench" "${common[@]}" --operation=read
  echo "== The same over RDMA, on two softrnic soft NICs (no RDMA hardware here):"
  echo "   64 KiB slices striped over both, every byte verified"
  LD_LIBRARY_PATH="$bin/transport/softrnic" \
    FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1,softrnic1=127.0.0.2 \
    "$bench" "${common[@]}" --protocol=rdma --operation=write
}

# Runs `bazel test` with the given flags and adds the gtest case counts of
# every test target to PASSED/FAILED. Bazel's own verdict per target wins:
# a target it reports as failed (a crash or sanitizer report after the
# cases passed, a timeout, a build failure) counts at least one failure.
# Each failing target is also printed as "failing: <target> ..." after
# bazel's output, which CI repeats at its end (bazel's FAIL lines scroll by
# in a long run and a truncated log may lose them).
PASSED=0
FAILED=0
run_tests() {
  local rc=0 out flags=() targets=()
  # Flags, then `--` and the targets (default: everything).
  while (($# > 0)); do
    if [[ "$1" == "--" ]]; then
      shift
      targets=("$@")
      break
    fi
    flags+=("$1")
    shift
  done
  ((${#targets[@]} > 0)) || targets=(//...)
  drop_execroot_link
  out="$(mktemp)"
  "${BAZEL[@]}" test "${flags[@]}" "${targets[@]}" 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  local logs tests_query t
  drop_execroot_link  # The test run made it again.
  logs="$("${BAZEL[@]}" info "${flags[@]}" bazel-testlogs 2>/dev/null)"
  tests_query="tests($(
    IFS=+
    echo "${targets[*]}"
  ))"
  for t in $("${BAZEL[@]}" query "$tests_query" 2>/dev/null); do
    local bad_target=0
    grep -qE "^$t[[:space:]]+.*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)" "$out" && bad_target=1
    local rel="${t#//}"
    rel="${rel/://}"
    local xml="$logs/$rel/test.xml"
    local tests="" failures=0 errors=0
    if [[ -f "$xml" ]]; then
      local head
      head="$(grep -m1 -o '<testsuites[^>]*>' "$xml" || true)"
      tests="$(sed -n 's/.* tests="\([0-9]*\)".*/\1/p' <<<"$head")"
      failures="$(sed -n 's/.* failures="\([0-9]*\)".*/\1/p' <<<"$head")"
      errors="$(sed -n 's/.* errors="\([0-9]*\)".*/\1/p' <<<"$head")"
    fi
    if [[ -z "$tests" ]]; then
      # No gtest report (shell test, crash, build failure): one verdict.
      if ((bad_target)) || [[ ! -f "$xml" ]] || grep -qE '<(failure|error)' "$xml"; then
        FAILED=$((FAILED + 1))
        echo "failing: $t"
      else
        PASSED=$((PASSED + 1))
      fi
      continue
    fi
    local bad=$((${failures:-0} + ${errors:-0}))
    if ((bad_target && bad == 0)); then bad=1; fi
    ((bad == 0)) || echo "failing: $t ($bad of $tests cases)"
    PASSED=$((PASSED + tests - (bad > tests ? tests : bad)))
    FAILED=$((FAILED + bad))
  done
  # Where the time went: the ten slowest test targets of this run (their
  # own time, as bazel reports it; a cached result shows its old time).
  echo "ten slowest tests:"
  grep -E '^//[^ ]+ +.*(PASSED|FAILED|TIMEOUT|FLAKY).* in [0-9.]+s' "$out" |
    sed -E 's|^(//[^ ]+) .* in ([0-9.]+)s.*|\2 \1|' | sort -rn | head -10 |
    awk '{printf "  %7.1f s  %s\n", $1, $2}' || true
  rm -f "$out"
  return $rc
}

# Under a sanitizer config (sanitize, asan, ubsan) the whole suite runs
# except the tests tagged no-sanitize: those run no code of Ferry's own
# making (the docs site's MkDocs build and browser check), so an
# instrumented build has nothing to find there. --config=sanitize is a
# clang build: it gets its own output base, as the other clang builds.
test_cmd() {
  setup
  local rc=0 a sanitizer=0
  for a in "$@"; do
    [[ "$a" == "--" ]] && { sanitizer=0; break; }  # The caller chose.
    [[ "$a" =~ ^--config=(sanitize|asan|ubsan)$ ]] && sanitizer=1
    [[ "$a" == --config=sanitize ]] && clang_bazel sanitize
  done
  if ((sanitizer)); then
    drop_execroot_link
    # With --config=sanitize, the whole tree first, not only what the tests
    # need: it is clang's build, with -Werror=thread-safety (--config=clang),
    # so this is also the thread-safety verdict on every target (CI has no
    # separate clang build of the tree).
    for a in "$@"; do
      [[ "$a" == --config=sanitize ]] || continue
      if ! "${BAZEL[@]}" build --config=sanitize -k //...; then
        echo "failing: the sanitize build of //... (clang, -Werror=thread-safety)"
        FAILED=$((FAILED + 1))
        rc=1
      fi
      drop_execroot_link  # The build made it again.
      break
    done
    local targets
    targets="$("${BAZEL[@]}" query "tests(//...) except attr(tags, 'no-sanitize', tests(//...))" 2>/dev/null)"
    # shellcheck disable=SC2086
    run_tests --build_tests_only "$@" -- $targets || rc=$?
  else
    run_tests "$@" || rc=$?
  fi
  echo "$PASSED passed, $FAILED failed"
  return $rc
}

# Builds everything with clang and -Werror=thread-safety: one verdict.
# With --config=tsan the build is also instrumented for ThreadSanitizer and
# made in TSan's output base with exactly TSan's flags, so that
# `tools/dev.sh tsan` after it compiles nothing again. (CI gets the verdict
# from `test --config=sanitize`, which builds the whole tree with clang.)
clang_check() {
  setup
  local base=clang cfg=(--config=clang) a
  for a in "$@"; do
    [[ "$a" == --config=tsan ]] && {
      base=tsan
      cfg=()  # --config=tsan includes clang's.
    }
  done
  clang_bazel "$base"
  drop_execroot_link
  if "${BAZEL[@]}" build "${cfg[@]}" -k //... "$@"; then
    PASSED=1
  else
    FAILED=1
    echo "failing: the clang build (-Werror=thread-safety)"
  fi
  echo "$PASSED passed, $FAILED failed"
  ((FAILED == 0))
}

# The concurrency-heavy tests under ThreadSanitizer (not those tagged
# no-tsan: they run uninstrumented programs, which cannot load an
# instrumented softrnic).
TSAN_SCOPE="//engine/... + //gpu/... + //metadata/... + //transport/... + //tests:e2e_test + //tests:rdma_engine_test + //tests:rdma_endpoint_test + //tests:mr_cache_test + //tests:gpu_engine_test + //tests:gpu_engine_no_gpudirect_test"
tsan() {
  setup
  clang_bazel tsan
  local rc=0 targets
  targets="$("${BAZEL[@]}" query "tests($TSAN_SCOPE) except attr(tags, 'no-tsan', tests($TSAN_SCOPE))" 2>/dev/null)"
  # shellcheck disable=SC2086
  # tsan_retry.sh runs a test again (at most twice) when it failed only
  # on reports that are gRPC's own (bazel/tsan_triage.py).
  run_tests --config=tsan "--run_under=$PWD/bazel/tsan_retry.sh" \
    "--test_env=TSAN_OPTIONS=suppressions=$PWD/bazel/tsan.supp halt_on_error=1 second_deadlock_stack=1 history_size=4" \
    "$@" -- $targets || rc=$?
  echo "$PASSED passed, $FAILED failed"
  return $rc
}

# Builds every libFuzzer target (bazel/fuzz.bzl) with clang and ASan and
# runs each for SECONDS (default 60) on a copy of its seed corpus, with its
# dictionary (<pkg>/fuzz/<x>.dict for <x>_fuzz_test); a crash or sanitizer
# report fails it, and its input is kept in .cache/fuzz/<target>/ (with
# the corpus it grew and the log).
fuzz() {
  setup
  local seconds="${1:-60}"
  clang_bazel fuzz
  local targets
  drop_execroot_link
  targets="$("${BAZEL[@]}" query 'attr(tags, "fuzzer", //...)' 2>/dev/null)"
  "${BAZEL[@]}" build --config=fuzz $targets || {
    echo "failing: the fuzz targets' build"
    echo "0 passed, 1 failed"
    return 1
  }
  local bin rc=0
  bin="$("${BAZEL[@]}" info --config=fuzz bazel-bin 2>/dev/null)"
  # One fuzzer per core at a time: each is single-threaded, so two cores
  # run two targets for their full time in the wall time of one.
  local jobs="${FUZZ_JOBS:-$(nproc)}" running=0 t
  for t in $targets; do
    fuzz_one "$bin" "$t" "$seconds" &
    running=$((running + 1))
    if ((running >= jobs)); then
      wait -n || true
      running=$((running - 1))
    fi
  done
  wait
  for t in $targets; do
    local base="${t##*:}"
    base="${base%_fuzzer}"
    local work=".cache/fuzz/$base"
    echo "=== fuzz $t for ${seconds}s"
    if [[ "$(cat "$work/status" 2>/dev/null)" == 0 ]]; then
      PASSED=$((PASSED + 1))
      grep -E "^(stat::number_of_executed_units|Done)" "$work/log.txt" || true
    else
      FAILED=$((FAILED + 1))
      rc=1
      tail -40 "$work/log.txt"
      echo "failing: $t (log: $work/log.txt)"
    fi
  done
  echo "$PASSED passed, $FAILED failed"
  return $rc
}

# Runs the libFuzzer binary of target T (built in BIN) for SECONDS on a
# fresh copy of its seed corpus; writes its exit status to
# .cache/fuzz/<target>/status and its output to log.txt there.
fuzz_one() {
  local bin=$1 t=$2 seconds=$3
  local pkg="${t#//}" name
  pkg="${pkg%%:*}"
  name="${t##*:}"
  local base="${name%_fuzzer}"
  local work=".cache/fuzz/$base"
  rm -rf "$work" && mkdir -p "$work/corpus"
  cp -r "$pkg/fuzz/${base}_corpus/." "$work/corpus/" 2>/dev/null || true
  # By convention the dictionary of <x>_fuzz_test is <pkg>/fuzz/<x>.dict.
  local dict=()
  [[ -f "$pkg/fuzz/${base%_fuzz_test}.dict" ]] &&
    dict=("-dict=$PWD/$pkg/fuzz/${base%_fuzz_test}.dict")
  local status=0
  (cd "$work" && "$bin/$pkg/$name" -max_total_time="$seconds" \
    -rss_limit_mb=4096 -timeout=60 -print_final_stats=1 "${dict[@]}" \
    corpus) >"$work/log.txt" 2>&1 || status=$?
  echo "$status" >"$work/status"
}

bench_tcp() {
  setup
  bench/bench_tcp.sh "$@"
}

format() {
  find . -path ./bazel-\* -prune -o \( -name '*.h' -o -name '*.cc' \) -print |
    xargs clang-format -i
}

# Builds the `ferry` Python package and installs it for Debian's
# /usr/bin/python3 (another python3 may come first on PATH), in the
# directory Debian's python3 reads local packages from; idempotent.
# Installs Ferry's stand-in `mooncake` package for interpreter $1 into
# its directory $2. A `mooncake` that is not ours (no FERRY_SHIM), where
# it would go or anywhere $1 imports it from, is never replaced unless $3
# is 1 (--force).
mooncake_install() {
  local py="$1" dir="$2" force="$3" theirs=""
  if [[ -e "$dir/mooncake" ]] && ! grep -qs FERRY_SHIM "$dir/mooncake/__init__.py"; then
    theirs="$dir/mooncake"
  fi
  local found
  found="$(cd / && "$py" -c 'import importlib.util as u; s = u.find_spec("mooncake"); print(s.origin if s and s.origin else (list(s.submodule_search_locations)[0] if s else ""))' 2>/dev/null || true)"
  [[ -d "$found" ]] && found="$found/__init__.py"  # A namespace package.
  if [[ -n "$found" ]] && ! grep -qs FERRY_SHIM "$found"; then
    theirs="${theirs:-$(dirname "$found")}"
  fi
  if [[ -n "$theirs" && "$force" != 1 ]]; then
    echo "error: $py has a Mooncake package ($theirs); Ferry's stand-in" \
      "would replace or hide it. Rerun with --force to install it anyway." >&2
    return 1
  fi
  [[ -n "$theirs" ]] && echo "note: --force: replacing or hiding $theirs for $py" >&2
  rm -rf "$dir/mooncake"
  mkdir -p "$dir/mooncake"
  cp python/mooncake/*.py "$dir/mooncake/"
  (cd / && "$py" -c 'from mooncake.engine import TransferEngine; import mooncake; assert getattr(mooncake, "FERRY_SHIM", False), mooncake.__file__; print("mooncake (Ferry'"'"'s stand-in) installed:", mooncake.__file__)')
}

python_install() {
  local as_mooncake=0 force=0
  for arg in "$@"; do
    case "$arg" in
      --as-mooncake) as_mooncake=1 ;;
      --force) force=1 ;;  # With --as-mooncake only.
      *)
        echo "usage: tools/dev.sh python [--as-mooncake [--force]]" >&2
        return 2
        ;;
    esac
  done
  if ((force && !as_mooncake)); then
    echo "usage: --force goes with --as-mooncake" >&2
    return 2
  fi
  setup
  drop_execroot_link
  "${BAZEL[@]}" build -c opt //python:_ferry.so
  local dest
  dest="$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_path("purelib", "posix_local"))')"
  rm -rf "$dest/ferry"
  mkdir -p "$dest/ferry"
  cp python/ferry/*.py python/ferry/*.pyi python/ferry/py.typed "$dest/ferry/"
  install -m 0755 "$("${BAZEL[@]}" info -c opt bazel-bin 2>/dev/null)/python/_ferry.so" "$dest/ferry/"
  (cd / && /usr/bin/python3 -c 'import ferry; print("ferry installed:", ferry.__file__)')
  if ((as_mooncake)); then
    mooncake_install /usr/bin/python3 "$dest" "$force" || return 1
  fi
  # Another python3 first on PATH (pyenv, a venv) gets a copy too when it
  # can load the extension (the same SOABI), so that a plain `python3`
  # imports ferry as well; otherwise say which interpreter has it.
  local soabi='import sysconfig; print(sysconfig.get_config_var("SOABI"))'
  local other
  other="$(cd / && python3 -c 'import sys; print(sys.executable)' 2>/dev/null || true)"
  if [[ -n "$other" && "$(readlink -f "$other")" != "$(readlink -f /usr/bin/python3)" ]]; then
    if [[ "$("$other" -c "$soabi")" == "$(/usr/bin/python3 -c "$soabi")" ]]; then
      local other_dest
      other_dest="$("$other" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
      rm -rf "$other_dest/ferry"
      cp -r "$dest/ferry" "$other_dest/ferry"
      if ((as_mooncake)); then
        mooncake_install "$other" "$other_dest" "$force" || return 1
      fi
      (cd / && "$other" -c 'import ferry; print("ferry installed:", ferry.__file__)')
    else
      echo "note: python3 on PATH is $other, which cannot load an extension" \
        "built for /usr/bin/python3; use /usr/bin/python3" >&2
    fi
  fi
}

case "${1:-}" in
  setup) setup ;;
  python) shift; python_install "$@" ;;
  wheel) shift; setup; bash devtools/wheel.sh "$@" ;;
  build) shift; setup; build "$@" ;;
  demo) demo ;;
  test) shift; test_cmd "$@" ;;
  bench-tcp) shift; bench_tcp "$@" ;;
  format) format ;;
  clang) shift; clang_check "$@" ;;
  # The package graph: no cycle, no edge upward (devtools/layering.py).
  layering)
    setup
    drop_execroot_link
    /usr/bin/python3 devtools/layering.py
    ;;
  tsan) shift; tsan "$@" ;;
  fuzz) shift; fuzz "$@" ;;
  *)
    echo "usage: tools/dev.sh setup|demo|test|build|python|wheel|bench-tcp|format|clang|layering|tsan|fuzz" >&2
    exit 2
    ;;
esac
