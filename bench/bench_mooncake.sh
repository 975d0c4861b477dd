#!/usr/bin/env bash
# Ferry against Mooncake TE, side by side, in one run: Ferry's
# transfer_bench and Mooncake's unmodified transfer_engine_bench, each a
# target and an initiator process on this host, interleaved round by round
# (the order alternating), on the same softrnic NICs (rdma1: softrnic0 on
# 127.0.0.1; rdma2: and softrnic1 on 127.0.0.2) and on loopback TCP.
# Mooncake's shape throughout: one initiator thread, batch 128, 1 GiB
# buffers; Mooncake with P2PHANDSHAKE metadata, by default and with
# MC_WORKERS_PER_CTX=1 (its best setting on two cores) on RDMA.
#   MOONCAKE_BENCH=/path/to/transfer_engine_bench bench/bench_mooncake.sh \
#     [rounds, default 3] [seconds, default 5]
# CELLS picks the cells ("config:op:block" words; default all 12):
#   CELLS="rdma2:write:1048576 rdma1:write:1048576" ...
# Prints one line per sample and, per cell, the medians (min-max) and the
# ratios Ferry / Mooncake. Mooncake is not built here: build it from its
# own source (docs/mooncake-comparison.md says how it was built).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
rounds="${1:-3}"
secs="${2:-5}"
MC="${MOONCAKE_BENCH:-}"
[[ -x "$MC" ]] || { echo "set MOONCAKE_BENCH to Mooncake's transfer_engine_bench" >&2; exit 2; }
if [[ -z "${OPT_NO_BUILD:-}" ]]; then
  bazel build -c opt //tools:transfer_bench //transport/softrnic:libibverbs.so.1 >/dev/null 2>&1 ||
    bazel build -c opt //tools:transfer_bench //transport/softrnic:libibverbs.so.1 || exit 1
fi
bin="${OPT_BIN:-$(bazel info -c opt bazel-bin 2>/dev/null)}"
FERRY="$bin/tools/transfer_bench"
export LD_LIBRARY_PATH="$bin/transport/softrnic"
# $tmp, $pids (killed at exit), free_port, wait_target_ready.
# shellcheck source=bench_lib.sh
source bench/bench_lib.sh
# Ends a target started under timeout: SIGTERM, which timeout passes on,
# then SIGKILL to whatever of it is left (killing timeout alone would leave
# the target running, and its NIC threads would load the next sample).
stop() {  # pid
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  pkill -9 -P "$1" 2>/dev/null
  kill -9 "$1" 2>/dev/null
  wait "$1" 2>/dev/null
}
read -r -a cells <<<"${CELLS:-tcp:write:65536 tcp:write:1048576 tcp:read:65536 tcp:read:1048576 rdma1:write:65536 rdma1:write:1048576 rdma1:read:65536 rdma1:read:1048576 rdma2:write:65536 rdma2:write:1048576 rdma2:read:65536 rdma2:read:1048576}"

devices() {  # config -> FERRY_SOFTRNIC_DEVICES
  case "$1" in
    rdma2) echo "softrnic0=127.0.0.1,softrnic1=127.0.0.2" ;;
    *) echo "softrnic0=127.0.0.1" ;;
  esac
}

# One Ferry sample: GB/s (10^9 bytes) on stdout, or nothing.
ferry() {  # config op block
  local proto=rdma port log="$tmp/ferry-target.log"
  [[ $1 == tcp ]] && proto=tcp
  port="$(free_port)"
  FERRY_SOFTRNIC_DEVICES="$(devices "$1")" timeout $((secs + 60)) "$FERRY" \
    --mode=target --protocol=$proto --listen_host=127.0.0.1 --rpc_port="$port" \
    --buffer_size=$((1 << 30)) --target_seconds=$((secs + 40)) >"$log" 2>&1 &
  pids+=($!)
  wait_target_ready "$log" "${pids[-1]}" || { stop "${pids[-1]}"; return; }
  FERRY_SOFTRNIC_DEVICES="$(devices "$1")" timeout $((secs + 40)) "$FERRY" \
    --mode=initiator --protocol=$proto --metadata_server="127.0.0.1:$port" \
    --listen_host=127.0.0.1 --operation="$2" --block_size="$3" --batch_size=128 \
    --threads=1 --buffer_size=$((1 << 30)) --warmup=1 --duration="$secs" \
    --report=json 2>"$tmp/ferry-init.err" | tail -1 |
    python3 -c 'import json,sys; print("%.3f" % json.load(sys.stdin)["throughput_gbps"])' 2>/dev/null
  stop "${pids[-1]}"
}

# One Mooncake sample (env: extra variables such as MC_WORKERS_PER_CTX=1).
mooncake() {  # config op block [VAR=value...]
  local cfg="$1" op="$2" block="$3" proto=rdma dev=softrnic0 log="$tmp/mc-target.log"
  shift 3
  [[ $cfg == tcp ]] && proto=tcp
  [[ $cfg == rdma2 ]] && dev=softrnic0,softrnic1
  env "$@" FERRY_SOFTRNIC_DEVICES="$(devices "$cfg")" timeout $((secs + 60)) "$MC" \
    --mode=target --metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1 \
    --protocol=$proto --device_name=$dev --buffer_size=$((1 << 30)) >"$log" 2>&1 &
  pids+=($!)
  local port=""
  for _ in $(seq 300); do
    port="$(grep -o 'listening on 127.0.0.1:[0-9]*' "$log" | head -1 | sed 's/.*://')"
    [[ -n "$port" ]] && break
    sleep 0.1
  done
  sleep 2  # Its target registers the 1 GiB buffer after it listens.
  env "$@" FERRY_SOFTRNIC_DEVICES="$(devices "$cfg")" timeout $((secs + 40)) "$MC" \
    --mode=initiator --metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1 \
    --segment_id="127.0.0.1:$port" --protocol=$proto --device_name=$dev \
    --operation="$op" --block_size="$block" --batch_size=128 --threads=1 \
    --duration="$secs" --buffer_size=$((1 << 30)) --report_precision=3 \
    >"$tmp/mc-init.log" 2>&1
  grep -o 'throughput [0-9.]* GB/s' "$tmp/mc-init.log" | tail -1 | awk '{print $2}'
  stop "${pids[-1]}"
}

declare -A got
for ((r = 1; r <= rounds; r++)); do
  for cell in "${cells[@]}"; do
    IFS=: read -r cfg op block <<<"$cell"
    runs=(ferry mc)
    [[ $cfg != tcp ]] && runs+=(mc1)
    # Alternate who goes first, round by round.
    ((r % 2 == 0)) && mapfile -t runs < <(printf '%s\n' "${runs[@]}" | tac)
    for who in "${runs[@]}"; do
      case $who in
        ferry) v="$(ferry "$cfg" "$op" "$block")" ;;
        mc) v="$(mooncake "$cfg" "$op" "$block")" ;;
        mc1) v="$(mooncake "$cfg" "$op" "$block" MC_WORKERS_PER_CTX=1)" ;;
      esac
      echo "round $r $cell $who ${v:-none}"
      got[$cell/$who]+="${v:-nan} "
    done
  done
done
echo "medians of $rounds rounds of ${secs} s, GB/s (min-max); one thread, batch 128, 1 GiB buffers"
for cell in "${cells[@]}"; do
  python3 - "$cell" "${got[$cell/ferry]}" "${got[$cell/mc]}" "${got[$cell/mc1]:-}" <<'EOF'
import math, statistics, sys
cell, ferry, mc, mc1 = sys.argv[1:5]
def parse(s):
    v = [float(x) for x in s.split() if x != "nan"]
    return (statistics.median(v), min(v), max(v)) if v else None
def fmt(m):
    return "none" if m is None else "%.3f (%.3f-%.3f)" % m
f, m, m1 = parse(ferry), parse(mc), parse(mc1)
line = "%s: ferry %s  mooncake %s" % (cell, fmt(f), fmt(m))
if m1 is not None:
    line += "  mooncake 1 worker/NIC %s" % fmt(m1)
if f and m:
    line += "  ratio to default %.2f" % (f[0] / m[0])
    best = max(m[0], m1[0]) if m1 else m[0]
    line += "  ratio to best %.2f" % (f[0] / best)
print(line)
EOF
done
