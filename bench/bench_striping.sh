#!/usr/bin/env bash
# Striping benchmark: two namespaced hosts joined by two veth links, each
# link shaped to the same rate with tc (so the links, not the CPU, are the
# limit), Ferry's RDMA transport on softrnic between them. Measures
# transfer_bench throughput with one NIC per host and with two, in the same
# run, and prints the ratio (two NICs should give close to 2x).
#   sudo bench/bench_striping.sh [rate, default 200mbit] [seconds, default 6]
# Extra initiator flags may be given in BENCH_FLAGS (e.g.
# BENCH_FLAGS=--qps_per_endpoint=1).
# Needs root (ip netns, tc). Removes everything it creates.
# OPT_NO_BUILD=1 skips the build (then OPT_BIN names the -c opt bazel-bin
# directory), as bench/opt_bench.sh: bench/bench_smoke_test.sh runs it so,
# from a test's runfiles, where bazel must not be called.
set -uo pipefail
cd "$(dirname "$0")/.."
rate="${1:-200mbit}"
secs="${2:-6}"
[[ $(id -u) -eq 0 ]] || { echo "needs root (ip netns, tc)" >&2; exit 2; }
if [[ -z "${OPT_NO_BUILD:-}" ]]; then
  bazel build -c opt //tools:transfer_bench //transport/softrnic:libibverbs.so.1 >/dev/null 2>&1 ||
    bazel build -c opt //tools:transfer_bench //transport/softrnic:libibverbs.so.1
fi
bin="${OPT_BIN:-$(bazel info -c opt bazel-bin 2>/dev/null)}"
BENCH="$bin/tools/transfer_bench"
LIBDIR="$bin/transport/softrnic"
# shellcheck source=../testing/netns_lib.sh
source testing/netns_lib.sh

netns_begin "s$$"
netns_setup || exit 1
netns_shape "$rate"

run() {  # label, h1 devices, h2 devices, port
  local label="$1" port="$4"
  H1_DEVICES="$2" H2_DEVICES="$3"
  in_h2 "$BENCH" --mode=target --protocol=rdma --listen_host="$B1" --rpc_port="$port" \
    --buffer_size=$((256 << 20)) --target_seconds=$((secs + 30)) >"$tmp/t$port.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do grep -q "target ready" "$tmp/t$port.log" && break; sleep 0.1; done
  in_h1 timeout $((secs + 60)) "$BENCH" --mode=initiator --protocol=rdma \
    --metadata_server="$B1:$port" --listen_host="$A1" --operation=write \
    --block_size=$((1 << 20)) --batch_size=16 --threads=2 \
    --buffer_size=$((256 << 20)) --warmup=3 --duration="$secs" --report=json \
    ${BENCH_FLAGS:-} 2>"$tmp/$label.err" | tail -1 >"$tmp/$label.json"
  kill -9 "${pids[-1]}" 2>/dev/null
  python3 -c 'import json,sys; print("%.4f" % json.load(open(sys.argv[1]))["throughput_gbps"])' \
    "$tmp/$label.json" 2>/dev/null && return
  echo "$label: no report; the initiator's and the target's last lines:" >&2
  tail -n 5 "$tmp/$label.err" "$tmp/t$port.log" >&2
  return 1
}
# A run that produced no report fails the script (no ratio of nothing).
one="$(run one "softrnic0=$A1" "softrnic0=$B1" 50801)" ||
  { echo "one-NIC run gave no result" >&2; exit 1; }
two="$(run two "softrnic0=$A1,softrnic1=$A2" "softrnic0=$B1,softrnic1=$B2" 50802)" ||
  { echo "two-NIC run gave no result" >&2; exit 1; }
echo "link rate $rate per NIC, 1 MiB RDMA WRITEs, 2 threads x 16 in flight"
echo "one NIC per host:  $one GB/s"
echo "two NICs per host: $two GB/s"
echo "ratio two/one: $(python3 -c "print('%.3f' % ($two / $one))")"
echo "last report: $(cat "$tmp/two.json")"
