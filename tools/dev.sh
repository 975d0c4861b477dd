#!/usr/bin/env bash
# Ferry's front door. On a fresh Debian 12 machine:
#   tools/dev.sh demo   # installs what is needed, builds, runs a demo transfer
#   tools/dev.sh test   # installs what is needed, runs the whole test suite
# Other subcommands: setup, build, bench-tcp, format.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  bazel-bootstrap pkg-config g++ python3
  libibverbs-dev libabsl-dev libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc libgtest-dev libgmock-dev
  libbenchmark-dev iperf3 ibverbs-utils iproute2 clang-format
)

setup() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" ||
      missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then return 0; fi
  echo "dev.sh: installing ${missing[*]}" >&2
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get -o DPkg::Lock::Timeout=600 update -q
  $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}"
}

BAZEL=(bazel)

build() {
  "${BAZEL[@]}" build -c opt //... "$@"
}

demo() {
  setup
  "${BAZEL[@]}" build -c opt //tools:transfer_bench //transport/softrnic:libibverbs.so.1
  local bin bench
  bin="$("${BAZEL[@]}" info -c opt bazel-bin 2>/dev/null)"
  bench="$bin/tools/transfer_bench"
  echo "== Ferry demo: two engines on loopback, embedded metadata service, TCP"
  echo "-- WRITE 1 MiB blocks, every byte verified (read back and compared)"
  "$bench" --mode=local --operation=write --block_size=1048576 --batch_size=8 \
    --buffer_size=$((256 << 20)) --duration=2 --verify
  echo "-- READ 1 MiB blocks, every byte verified against the target's pattern"
  "$bench" --mode=local --operation=read --block_size=1048576 --batch_size=8 \
    --buffer_size=$((256 << 20)) --duration=2 --verify
  echo "-- WRITE throughput, 1 MiB blocks"
  "$bench" --mode=local --operation=write --block_size=1048576 --batch_size=8 \
    --buffer_size=$((256 << 20)) --duration=3
  echo "== The same over RDMA, on two softrnic soft NICs (no RDMA hardware here):"
  echo "   64 KiB slices striped over both, every byte verified"
  LD_LIBRARY_PATH="$bin/transport/softrnic" \
    FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1,softrnic1=127.0.0.2 \
    "$bench" --mode=local --protocol=rdma --operation=write \
    --block_size=1048576 --batch_size=8 --buffer_size=$((256 << 20)) \
    --duration=2 --verify
}

# Runs `bazel test` with the given flags and adds the gtest case counts of
# every test target to PASSED/FAILED. Bazel's own verdict per target wins:
# a target it reports as failed (a crash or sanitizer report after the
# cases passed, a timeout, a build failure) counts at least one failure.
PASSED=0
FAILED=0
run_tests() {
  local rc=0 out
  out="$(mktemp)"
  "${BAZEL[@]}" test "$@" //... 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  local logs targets t
  logs="$("${BAZEL[@]}" info "$@" bazel-testlogs 2>/dev/null)"
  targets="$("${BAZEL[@]}" query 'tests(//...)' 2>/dev/null)"
  for t in $targets; do
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
      else
        PASSED=$((PASSED + 1))
      fi
      continue
    fi
    local bad=$((${failures:-0} + ${errors:-0}))
    if ((bad_target && bad == 0)); then bad=1; fi
    PASSED=$((PASSED + tests - (bad > tests ? tests : bad)))
    FAILED=$((FAILED + bad))
  done
  rm -f "$out"
  return $rc
}

test_cmd() {
  setup
  local rc=0
  run_tests "$@" || rc=$?
  echo "$PASSED passed, $FAILED failed"
  return $rc
}

bench_tcp() {
  setup
  tools/bench_tcp.sh "$@"
}

format() {
  find . -path ./bazel-\* -prune -o \( -name '*.h' -o -name '*.cc' \) -print |
    xargs clang-format -i
}

case "${1:-}" in
  setup) setup ;;
  build) shift; setup; build "$@" ;;
  demo) demo ;;
  test) shift; test_cmd "$@" ;;
  bench-tcp) shift; bench_tcp "$@" ;;
  format) format ;;
  *)
    echo "usage: tools/dev.sh setup|demo|test|build|bench-tcp|format" >&2
    exit 2
    ;;
esac
