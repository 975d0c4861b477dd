#!/usr/bin/env bash
# The same-host path against the two ways Mooncake TE moves bytes between
# processes of one host: loopback TCP and RDMA through the NIC (softrnic
# here, whose loopback is itself TCP: not a real NIC's). One transfer_bench
# target serves shm, rdma and tcp; each sample is an initiator process that
# uses one of them, WRITE and READ, 64 KiB and 1 MiB blocks, interleaved
# round by round; memcpy (one thread, memcpy_bench) is measured in the same
# run as the reference. Prints every sample, then per cell the median
# (min-max) GB/s, the ratios shm/tcp and shm/rdma, and CPU seconds per GB,
# both ends together.
#   bench/bench_same_host.sh [rounds] [seconds-per-sample]
# CELLS overrides the cells ("write:65536 read:1048576 ...").
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
secs="${2:-3}"
if [[ -z "${OPT_NO_BUILD:-}" ]]; then
  targets=(//tools:transfer_bench //transport/softrnic:libibverbs.so.1 //bench:memcpy_bench)
  bazel build -c opt "${targets[@]}" >/dev/null 2>&1 ||
    bazel build -c opt "${targets[@]}" || exit 1
fi
bin="${OPT_BIN:-$(bazel info -c opt bazel-bin 2>/dev/null)}"
FERRY="$bin/tools/transfer_bench"
export LD_LIBRARY_PATH="$bin/transport/softrnic"
export FERRY_SOFTRNIC_DEVICES="softrnic0=127.0.0.1"
# $tmp, $pids (killed at exit), free_port, wait_target_ready.
# shellcheck source=bench_lib.sh
source bench/bench_lib.sh
read -r -a cells <<<"${CELLS:-write:65536 write:1048576 read:65536 read:1048576}"
buffer=$((256 << 20))

port="$(free_port)"
timeout $((rounds * 60 * ${#cells[@]} + 120)) "$FERRY" --mode=target \
  --protocol=shm,rdma,tcp --listen_host=127.0.0.1 --rpc_port="$port" \
  --buffer_size="$buffer" >"$tmp/target.log" 2>&1 &
pids+=($!)
wait_target_ready "$tmp/target.log" "${pids[-1]}" || { cat "$tmp/target.log"; exit 1; }
# The target itself, not `timeout` (its CPU is what the samples charge).
target_pid="$(pgrep -P "${pids[-1]}" -f transfer_bench | head -1)"

ticks_per_s="$(getconf CLK_TCK)"
proc_cpu() {  # pid -> CPU seconds so far (utime + stime)
  awk -v hz="$ticks_per_s" '{print ($14 + $15) / hz}' "/proc/$1/stat"
}

# One sample: "GB/s CPU-s-per-GB" on stdout, or "- -". CPU counts both
# ends: the initiator's over its measured window (its report's cpu_s),
# and the target's over the sample's run, scaled to the window's share of
# the run's wall time (an estimate, as in bench_tcp.sh).
sample() {  # protocol op block
  local cpu0 t0
  cpu0="$(proc_cpu "$target_pid")"
  t0="$(date +%s.%N)"
  timeout $((secs + 60)) "$FERRY" --mode=initiator --protocol="$1" \
    --metadata_server="127.0.0.1:$port" --listen_host=127.0.0.1 \
    --operation="$2" --block_size="$3" --batch_size=128 --threads=1 \
    --buffer_size="$buffer" --warmup=1 --duration="$secs" --report=json \
    2>"$tmp/init.err" | tail -1 >"$tmp/init.json"
  python3 -c 'import json,sys
r = json.loads(open(sys.argv[1]).read())
target = (float(sys.argv[2]) - float(sys.argv[3])) * r["seconds"] / (float(sys.argv[4]) - float(sys.argv[5]))
print("%.3f %.3f" % (r["throughput_gbps"], (r["cpu_s"] + target) / (r["bytes"] / 1e9)))' \
    "$tmp/init.json" "$(proc_cpu "$target_pid")" "$cpu0" "$(date +%s.%N)" "$t0" 2>/dev/null ||
    { echo "- -"; sed 's/^/  /' "$tmp/init.err" | tail -3 >&2; }
}

# memcpy, one thread, the cells' block sizes: GB/s.
memcpy_ref() {  # block
  "$bin/bench/memcpy_bench" --benchmark_filter="BM_Memcpy/$1\$" \
    --benchmark_min_time=1 --benchmark_format=json 2>/dev/null |
    python3 -c 'import json,sys
print("%.3f" % (json.load(sys.stdin)["benchmarks"][0]["bytes_per_second"] / 1e9))'
}

declare -A got cpu
protos=(shm tcp rdma)
for ((r = 1; r <= rounds; r++)); do
  for cell in "${cells[@]}"; do
    IFS=: read -r op block <<<"$cell"
    order=("${protos[@]}")
    # Rotate who goes first, round by round.
    for ((k = 0; k < (r - 1) % 3; k++)); do order=("${order[@]:1}" "${order[0]}"); done
    line="round $r $op $block:"
    for p in "${order[@]}"; do
      read -r v c <<<"$(sample "$p" "$op" "$block")"
      got[$p:$cell]+="$v "
      cpu[$p:$cell]+="$c "
      line+=" $p $v GB/s ($c CPU s/GB)"
    done
    m="$(memcpy_ref "$block")"
    got[memcpy:$cell]+="$m "
    echo "$line; memcpy $m GB/s"
  done
done

stats() {  # values... -> "median (min-max)"
  python3 -c 'import statistics,sys
v = [float(x) for x in sys.argv[1:] if x != "-"]
print("%.3f (%.3f-%.3f)" % (statistics.median(v), min(v), max(v)) if v else "-")' "$@"
}
med() {
  python3 -c 'import statistics,sys
v = [float(x) for x in sys.argv[1:] if x != "-"]
print(statistics.median(v) if v else "nan")' "$@"
}
echo
echo "cell | shm | tcp | rdma (softrnic) | memcpy 1 thread | shm/tcp | shm/rdma | shm/memcpy | CPU s/GB both ends: shm, tcp, rdma"
for cell in "${cells[@]}"; do
  # shellcheck disable=SC2086
  {
    s="$(med ${got[shm:$cell]})"
    t="$(med ${got[tcp:$cell]})"
    d="$(med ${got[rdma:$cell]})"
    mc="$(med ${got[memcpy:$cell]})"
    echo "$cell | $(stats ${got[shm:$cell]}) | $(stats ${got[tcp:$cell]}) |" \
      "$(stats ${got[rdma:$cell]}) | $(stats ${got[memcpy:$cell]}) |" \
      "$(python3 -c "print('%.2f' % ($s / $t))") | $(python3 -c "print('%.2f' % ($s / $d))") |" \
      "$(python3 -c "print('%.2f' % ($s / $mc))") |" \
      "$(med ${cpu[shm:$cell]}), $(med ${cpu[tcp:$cell]}), $(med ${cpu[rdma:$cell]})"
  }
done
