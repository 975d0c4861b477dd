#!/usr/bin/env bash
# Compares Ferry's TCP transport with single-stream iperf3 on loopback, in
# the same run: transfer_bench target and initiator as two processes moving
# 1 MiB WRITEs over one TCP connection, against `iperf3 -P 1` with its
# default 128 KiB writes and with 1 MiB writes. Shared machines are noisy,
# so the three measurements are interleaved for several rounds and the
# medians are compared. Prints every sample, the medians and the ratio
# against the faster iperf3 variant; and CPU seconds per GB moved, both
# ends together, against iperf3's (its -J report's CPU utilization of
# client and server): Ferry's initiator reports its own CPU over the
# measured window (cpu_s), and the target's is its /proc CPU time over the
# run, scaled to the measured share of the run's wall time.
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
target_pid=$!
wait_target_ready "$tmp/target.log" || { cat "$tmp/target.log"; exit 1; }

# Two initiator threads keep one TCP connection busy while the other waits
# for its batch, as iperf3's single stream is never idle.
ticks_per_s="$(getconf CLK_TCK)"
proc_cpu() {  # pid -> CPU seconds so far (utime + stime)
  awk -v hz="$ticks_per_s" '{print ($14 + $15) / hz}' "/proc/$1/stat"
}
ferry_run() {
  local cpu0 t0
  cpu0="$(proc_cpu "$target_pid")"
  t0="$(date +%s.%N)"
  "$bench" --mode=initiator --metadata_server="127.0.0.1:$mport" \
    --segment_id=target --operation=write --block_size=1048576 \
    --batch_size=16 --threads=2 --tcp_connections=1 \
    --buffer_size=$((${FERRY_BENCH_BUFFER_MB:-512} << 20)) --warmup=1 --duration="$secs" \
    --report=json >"$tmp/ferry.json" 2>"$tmp/ferry.err" ||
    { cat "$tmp/ferry.err" >&2; exit 1; }
  tail -1 "$tmp/ferry.json" >>"$tmp/ferry_reports"
  # CPU s per GB: the initiator's over its window, the target's over the
  # run scaled to the window's share of the run's wall time.
  python3 -c 'import json,sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
target = (float(sys.argv[2]) - float(sys.argv[3])) * r["seconds"] / (float(sys.argv[4]) - float(sys.argv[5]))
print("%.3f" % ((r["cpu_s"] + target) / (r["bytes"] / 1e9)))' \
    "$tmp/ferry.json" "$(proc_cpu "$target_pid")" "$cpu0" "$(date +%s.%N)" "$t0" >>"$tmp/ferry_cpu"
  python3 -c 'import json,sys; print("%.4f" % json.loads(open(sys.argv[1]).read().splitlines()[-1])["throughput_gbps"])' "$tmp/ferry.json"
}

# iperf3's CPU s per GB, client and server: their CPU utilization (a
# share of one CPU over the test) over the throughput.
iperf_cpu() {
  python3 -c 'import json,sys
d = json.load(open(sys.argv[1])); c = d["end"]["cpu_utilization_percent"]
r = d["end"]["sum_received"]
print("%.3f" % ((c["host_total"] + c["remote_total"]) / 100 * r["seconds"] / (r["bytes"] / 1e9)))' "$tmp/iperf.json"
}

d=() m=() f=() dc=() mc=()
for r in $(seq "$rounds"); do
  d+=("$(iperf_run)")
  dc+=("$(iperf_cpu)")
  m+=("$(iperf_run -l 1M)")
  mc+=("$(iperf_cpu)")
  f+=("$(ferry_run)")
  echo "round $r: iperf3 128K ${d[-1]}  iperf3 1M ${m[-1]}  ferry ${f[-1]} GB/s;" \
    "CPU s/GB: iperf3 128K ${dc[-1]}  iperf3 1M ${mc[-1]}  ferry $(tail -1 "$tmp/ferry_cpu")"
done

md="$(median "${d[@]}")"
mm="$(median "${m[@]}")"
mf="$(median "${f[@]}")"
ref="$(python3 -c "print(max($md, $mm))")"
echo "median iperf3 single stream, 128 KiB writes: $md GB/s"
echo "median iperf3 single stream, 1 MiB writes:   $mm GB/s"
echo "median ferry tcp WRITE 1 MiB, 2 processes:   $mf GB/s"
echo "ratio ferry/iperf3 (faster variant): $(python3 -c "print('%.3f' % ($mf / $ref))")"
mapfile -t fc <"$tmp/ferry_cpu"
mdc="$(median "${dc[@]}")"
mmc="$(median "${mc[@]}")"
mfc="$(median "${fc[@]}")"
echo "median CPU s per GB (both ends): iperf3 128K $mdc, iperf3 1M $mmc, ferry $mfc"
echo "ratio ferry/iperf3 CPU per GB (the cheaper variant): $(python3 -c "print('%.2f' % ($mfc / min($mdc, $mmc)))")"
echo "last ferry report: $(tail -1 "$tmp/ferry_reports")"
