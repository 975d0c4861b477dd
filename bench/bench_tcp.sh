#!/usr/bin/env bash
# Compares Ferry's TCP transport with single-stream iperf3 on loopback, in
# the same run: transfer_bench target and initiator as two processes moving
# 1 MiB WRITEs over one TCP connection, against `iperf3 -P 1` with its
# default 128 KiB writes and with 1 MiB writes. Shared machines are noisy,
# so the three measurements are interleaved for several rounds and the
# medians are compared. Prints every sample, the medians and the ratio
# against the faster iperf3 variant.
#   bench/bench_tcp.sh [seconds-per-sample] [rounds]   (or tools/dev.sh bench-tcp)
# FERRY_BENCH_BUFFER_MB sets the registered buffer size (default 512).
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-4}"
rounds="${2:-3}"
bazel build -c opt //tools:transfer_bench >/dev/null 2>&1 ||
  bazel build -c opt //tools:transfer_bench
bench="$(bazel info -c opt bazel-bin 2>/dev/null)/tools/transfer_bench"
command -v iperf3 >/dev/null || { echo "iperf3 missing: tools/dev.sh setup" >&2; exit 2; }

# A scratch $tmp, and $pids killed on exit.
source bench/bench_lib.sh

# The Ferry target stays up for all rounds.
mport="$(free_port)"
"$bench" --mode=target --segment_id=target --rpc_port="$mport" \
  --buffer_size=$((512 << 20)) >"$tmp/target.log" 2>&1 &
pids+=($!)
wait_target_ready "$tmp/target.log" || { cat "$tmp/target.log"; exit 1; }

# Two initiator threads keep one TCP connection busy while the other waits
# for its batch, as iperf3's single stream is never idle.
ferry_run() {
  "$bench" --mode=initiator --metadata_server="127.0.0.1:$mport" \
    --segment_id=target --operation=write --block_size=1048576 \
    --batch_size=16 --threads=2 --tcp_connections=1 \
    --buffer_size=$((${FERRY_BENCH_BUFFER_MB:-512} << 20)) --warmup=1 --duration="$secs" \
    --report=json >"$tmp/ferry.json" 2>"$tmp/ferry.err" ||
    { cat "$tmp/ferry.err" >&2; exit 1; }
  tail -1 "$tmp/ferry.json" >>"$tmp/ferry_reports"
  python3 -c 'import json,sys; print("%.4f" % json.loads(open(sys.argv[1]).read().splitlines()[-1])["throughput_gbps"])' "$tmp/ferry.json"
}

d=() m=() f=()
for r in $(seq "$rounds"); do
  d+=("$(iperf_run)")
  m+=("$(iperf_run -l 1M)")
  f+=("$(ferry_run)")
  echo "round $r: iperf3 128K ${d[-1]}  iperf3 1M ${m[-1]}  ferry ${f[-1]} GB/s"
done

md="$(median "${d[@]}")"
mm="$(median "${m[@]}")"
mf="$(median "${f[@]}")"
ref="$(python3 -c "print(max($md, $mm))")"
echo "median iperf3 single stream, 128 KiB writes: $md GB/s"
echo "median iperf3 single stream, 1 MiB writes:   $mm GB/s"
echo "median ferry tcp WRITE 1 MiB, 2 processes:   $mf GB/s"
echo "ratio ferry/iperf3 (faster variant): $(python3 -c "print('%.3f' % ($mf / $ref))")"
echo "last ferry report: $(tail -1 "$tmp/ferry_reports")"
