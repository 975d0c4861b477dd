#!/usr/bin/env bash
# Runs every MEASURE block of optimisation-part4.md, in order, into
# OUT (default .ci/drafts/measure-2026-12-06/out), each to its own file.
# From the repository root, on a machine with nothing else running.
set -uo pipefail
out="${1:-.ci/drafts/measure-2026-12-06/out}"
mkdir -p "$out"
bazel build -c opt //tools:transfer_bench //bench:engine_bench \
  //transport/softrnic:loopback_benchmark //transport/softrnic:libibverbs.so.1 >&2 || exit 1
export OPT_NO_BUILD=1 OPT_BIN="$(bazel info -c opt bazel-bin 2>/dev/null)"
bin="$OPT_BIN"
git rev-parse --short HEAD >"$out/commit"
W="--operation=write --block_size=65536 --block_stride=131072 --threads=1 --duration=3 --warmup=1"
depths=("--batch_size=1" "--batch_size=4" "--batch_size=16" "--batch_size=64" "--batch_size=256" "--batch_size=512" "--batch_size=1024")
run() { local name=$1; shift; echo "== $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >&2; "$@" >"$out/$name.txt" 2>&1; }
run qd1-gbps env OPT_FLAGS="$W" bench/opt_bench.sh -r 3 -f throughput_gbps "${depths[@]}"
run qd1-p50 env OPT_FLAGS="$W" bench/opt_bench.sh -r 3 -f p50_us "${depths[@]}"
run qd2 env OPT_FLAGS="--operation=write --block_size=65536 --threads=1 --duration=3 --warmup=1" \
  bench/opt_bench.sh -r 3 "--batch_size=16" "--batch_size=16 --block_stride=131072" \
  "--batch_size=128" "--batch_size=128 --block_stride=131072"
Q="--operation=write --block_size=65536 --block_stride=131072 --batch_size=1024 --threads=1 --duration=3 --warmup=1"
run qd3-gbps env OPT_FLAGS="$Q" bench/opt_bench.sh -r 3 -f throughput_gbps "--qps_per_endpoint=1" "--qps_per_endpoint=2" "--qps_per_endpoint=4"
run qd3-p50 env OPT_FLAGS="$Q" bench/opt_bench.sh -r 3 -f p50_us "--qps_per_endpoint=1" "--qps_per_endpoint=2" "--qps_per_endpoint=4"
T=("--threads=1 --batch_size=64" "--threads=2 --batch_size=32" "--threads=4 --batch_size=16" "--threads=8 --batch_size=8")
run qd4-gbps env OPT_FLAGS="$W" bench/opt_bench.sh -r 3 -f throughput_gbps "${T[@]}"
run qd4-p50 env OPT_FLAGS="$W" bench/opt_bench.sh -r 3 -f p50_us "${T[@]}"
run qd5 bench/opt_perftest.sh -r 3 -m rate ib_write_bw "-s 65536 -D 3 -f 1 -Q 1 -t 1" "-s 65536 -D 3 -f 1 -Q 1 -t 4" \
  "-s 65536 -D 3 -f 1 -Q 1 -t 16" "-s 65536 -D 3 -f 1 -Q 1 -t 64" "-s 65536 -D 3 -f 1 -Q 1 -t 256" \
  "-s 65536 -D 3 -f 1 -Q 1 -t 1024"
run qd6-perftest bench/opt_perftest.sh -r 3 -m bw ib_read_bw "-s 65536 -D 3 -f 1 -t 16 -o 1" "-s 65536 -D 3 -f 1 -t 16 -o 4" \
  "-s 65536 -D 3 -f 1 -t 16 -o 16" "-s 65536 -D 3 -f 1 -t 1 -o 16"
run qd6-ferry env OPT_FLAGS="--operation=read --block_size=65536 --block_stride=131072 --threads=1 --duration=3 --warmup=1" \
  bench/opt_bench.sh -r 3 "--batch_size=1" "--batch_size=4" "--batch_size=16" "--batch_size=64" "--batch_size=256"
export FERRY_SOFTRNIC_LIB_DIR="$bin/transport/softrnic"
run mr1 env FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 tools/softrnic-run "$bin/bench/engine_bench" \
  --benchmark_filter=BM_EngineWriteUnregisteredSource --benchmark_repetitions=5 \
  --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
run mr2 env FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 tools/softrnic-run "$bin/bench/engine_bench" \
  --benchmark_filter=BM_EngineWriteCacheWorkingSet --benchmark_repetitions=5 \
  --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
F='BM_RegDereg|BM_RdmaWriteRegisterEach|BM_RdmaWriteChain/size:(4096|1048576)/chain:1/'
run mr3 tools/softrnic-run "$bin/transport/softrnic/loopback_benchmark" --benchmark_filter="$F" \
  --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
run mr3-strict env FERRY_SOFTRNIC_STRICT_PAGES=1 tools/softrnic-run "$bin/transport/softrnic/loopback_benchmark" --benchmark_filter="$F" \
  --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
echo "== done $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
