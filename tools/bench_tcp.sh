#!/usr/bin/env bash
# Compares Ferry's TCP transport with single-stream iperf3 on loopback, in
# the same run: transfer_bench target and initiator as two processes, 1 MiB
# WRITEs, against `iperf3 -P 1`. Prints both and the ratio.
#   tools/bench_tcp.sh [seconds]      (run via: tools/dev.sh bench-tcp)
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-5}"
bench=bazel-bin/tools/transfer_bench
[[ -x "$bench" ]] || { echo "build first: bazel build -c opt //tools:transfer_bench" >&2; exit 2; }
command -v iperf3 >/dev/null || { echo "iperf3 missing: tools/dev.sh setup" >&2; exit 2; }

tmp="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# iperf3: one stream, 1 s omitted as warm-up, like transfer_bench --warmup.
iport="$(free_port)"
iperf3 -s -1 -B 127.0.0.1 -p "$iport" >/dev/null 2>&1 &
pids+=($!)
sleep 0.5
iperf3 -c 127.0.0.1 -p "$iport" -P 1 -O 1 -t "$secs" -J >"$tmp/iperf.json"
iperf_gbps="$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.4f" % (d["end"]["sum_received"]["bits_per_second"]/8e9))' "$tmp/iperf.json")"

# Ferry: target and initiator in two processes on loopback.
mport="$(free_port)"
"$bench" --mode=target --segment_id=target --rpc_port="$mport" \
  --buffer_size=$((512 << 20)) >"$tmp/target.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q "target ready" "$tmp/target.log" && break; sleep 0.1; done
grep -q "target ready" "$tmp/target.log" || { cat "$tmp/target.log"; exit 1; }
"$bench" --mode=initiator --metadata_server="127.0.0.1:$mport" \
  --segment_id=target --operation=write --block_size=1048576 --batch_size=8 \
  --threads=1 --tcp_connections=1 --buffer_size=$((512 << 20)) \
  --warmup=1 --duration="$secs" --report=json >"$tmp/ferry.json" 2>/dev/null
ferry_line="$(tail -1 "$tmp/ferry.json")"
ferry_gbps="$(python3 -c 'import json,sys; print("%.4f" % json.loads(sys.argv[1])["throughput_gbps"])' "$ferry_line")"

ratio="$(python3 -c "print('%.3f' % ($ferry_gbps / $iperf_gbps))")"
echo "iperf3 single stream (loopback): $iperf_gbps GB/s"
echo "ferry tcp WRITE 1 MiB (2 procs): $ferry_gbps GB/s"
echo "ratio ferry/iperf3: $ratio"
echo "ferry report: $ferry_line"
