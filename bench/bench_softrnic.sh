#!/usr/bin/env bash
# softrnic throughput and latency against single-stream iperf3 on loopback,
# in the same run: bench/verbs_bench moves 1 MiB RDMA_WRITEs (8 in flight)
# between two processes on softrnic0, interleaved for several rounds with
# iperf3 (128 KiB and 1 MiB writes); medians are compared, the ratio against
# the faster iperf3 variant. Then 8-byte RDMA_WRITE round trips (post to
# completion), p50/p99, against the reference of the same run: two threads'
# pipe round trip (verbs_bench --mode=wake). softrnic's round trip is four
# thread wake-ups, the pipe's two, so on a VM whose wake-ups are slow both
# are slow: compare the ratio, not the microseconds.
#   bench/bench_softrnic.sh [seconds-per-sample] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-4}"
rounds="${2:-3}"
bazel build -c opt //bench:verbs_bench //transport/softrnic:libibverbs.so.1 >/dev/null 2>&1 ||
  bazel build -c opt //bench:verbs_bench //transport/softrnic:libibverbs.so.1
bin="$(bazel info -c opt bazel-bin 2>/dev/null)"
export FERRY_SOFTRNIC_LIB_DIR="$bin/transport/softrnic"
export FERRY_SOFTRNIC_DEVICES="softrnic0=127.0.0.1"
bench="$bin/bench/verbs_bench"

# A scratch $tmp, and $pids killed on exit.
source bench/bench_lib.sh

verbs_run() {
  local port
  port="$(free_port)"
  tools/softrnic-run "$bench" --role=server --port="$port" >/dev/null 2>&1 &
  pids+=($!)
  tools/softrnic-run "$bench" --role=client --port="$port" "$@" \
    --duration="$secs" >"$tmp/verbs.json"
  wait "${pids[-1]}" 2>/dev/null || true
}

d=() m=() f=()
for r in $(seq "$rounds"); do
  d+=("$(iperf_run)")
  m+=("$(iperf_run -l 1M)")
  verbs_run --mode=bw --size=1048576 --window=8
  f+=("$(json_field "$tmp/verbs.json" throughput_gbps)")
  echo "round $r: iperf3 128K ${d[-1]}  iperf3 1M ${m[-1]}  softrnic RDMA_WRITE 1M ${f[-1]} GB/s"
done
md="$(median "${d[@]}")"
mm="$(median "${m[@]}")"
mf="$(median "${f[@]}")"
ref="$(python3 -c "print(max($md, $mm))")"
echo "median iperf3 single stream, 128 KiB writes: $md GB/s"
echo "median iperf3 single stream, 1 MiB writes:   $mm GB/s"
echo "median softrnic RDMA_WRITE 1 MiB, 2 procs:   $mf GB/s"
echo "ratio softrnic/iperf3 (faster variant): $(python3 -c "print('%.3f' % ($mf / $ref))")"
verbs_run --mode=lat
echo "8-byte RDMA_WRITE round trip: p50 $(json_field "$tmp/verbs.json" p50_us) us, p99 $(json_field "$tmp/verbs.json" p99_us) us ($(json_field "$tmp/verbs.json" samples) samples)"
"$bench" --mode=wake --duration="$secs" >"$tmp/wake.json"
echo "reference, two threads' pipe round trip (2 wake-ups): p50 $(json_field "$tmp/wake.json" p50_us) us, p99 $(json_field "$tmp/wake.json" p99_us) us"
echo "ratio softrnic round trip / two pipe round trips (4 wake-ups each): $(python3 -c "print('%.2f' % ($(json_field "$tmp/verbs.json" p50_us) / (2 * $(json_field "$tmp/wake.json" p50_us))))")"
