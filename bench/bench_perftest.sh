#!/usr/bin/env bash
# Ferry's engine against the raw-verbs ceiling of the same soft NIC, in the
# same run: Debian's unmodified perftest (ib_write_bw, ib_read_bw) and
# transfer_bench --protocol=rdma, each between two processes on softrnic0
# (127.0.0.1), one QP's worth of work in flight, 1 MiB messages,
# interleaved for several rounds; medians and the ratio engine/perftest.
# What it says: what Ferry's engine (slicing, batches, completion
# tracking, the metadata and handshake it needs) costs on top of raw verbs.
# softrnic loopback is not a real NIC: compare ratios, not absolute GB/s.
#   bench/bench_perftest.sh [seconds-per-sample] [rounds]
# OPT_NO_BUILD=1 skips the build (then OPT_BIN names the -c opt bazel-bin
# directory), as bench/opt_bench.sh: bench/bench_smoke_test.sh runs it so,
# from a test's runfiles, where bazel must not be called.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-4}"
rounds="${2:-3}"
size=$((1 << 20))
if [[ -z "${OPT_NO_BUILD:-}" ]]; then
  targets=(//tools:transfer_bench //transport/softrnic:libibverbs.so.1)
  bazel build -c opt "${targets[@]}" >/dev/null 2>&1 || bazel build -c opt "${targets[@]}"
fi
command -v ib_write_bw >/dev/null || { echo "needs perftest (tools/dev.sh setup)"; exit 1; }
bin="${OPT_BIN:-$(bazel info -c opt bazel-bin 2>/dev/null)}"
export LD_LIBRARY_PATH="$bin/transport/softrnic"
export FERRY_SOFTRNIC_DEVICES="softrnic0=127.0.0.1"

# A scratch $tmp, and $pids killed on exit.
source bench/bench_lib.sh

# perftest's average bandwidth in GB/s (10^9 bytes, as transfer_bench).
# perftest prints MB/sec of 2^20 bytes (checked: 48,933 x 64 KiB in 3 s
# printed as 1019.42).
# On a failure: perftest's last lines on stderr and "nan", which the
# medians and ratios carry through and bench_smoke_test rejects.
perftest_run() {  # tool
  local port gbps
  port="$(free_port)"
  timeout 120 "$1" -d softrnic0 -x 0 "${PERFTEST_SOFTRNIC[@]}" -p "$port" \
    -s "$size" -D "$secs" >"$tmp/perftest_server.txt" 2>&1 &
  pids+=($!)
  local listened=yes
  wait_listening "$port" "${pids[-1]}" || listened=no
  timeout 120 "$1" -d softrnic0 -x 0 "${PERFTEST_SOFTRNIC[@]}" -p "$port" \
    -s "$size" -D "$secs" 127.0.0.1 >"$tmp/perftest.txt" 2>&1 ||
    kill "${pids[-1]}" 2>/dev/null || true  # else it waits for a peer for 120 s
  wait "${pids[-1]}" 2>/dev/null || true
  gbps="$(awk -v s="$size" '$1 == s && NF >= 4 {printf "%.4f\n", $4 * 1048576 / 1e9}' \
    "$tmp/perftest.txt" | tail -1)"
  if [[ -z "$gbps" ]]; then
    echo "$1 gave no result (server listening on $port: $listened); client, then server:" >&2
    tail -n 5 "$tmp/perftest.txt" "$tmp/perftest_server.txt" >&2
    gbps=nan
  fi
  echo "$gbps"
}

# A preloaded sanitizer runtime (tests set one for perftest, which is not
# instrumented) is perftest's: transfer_bench carries its own, and clang's
# refuses to start beside a second copy.
bench_run() {  # read|write
  local port
  port="$(free_port)"
  # Emptied here, before the target starts: the redirection below empties
  # it only when the child process gets to it, and until then the previous
  # sample's "target ready" would end the wait at once.
  : >"$tmp/target.log"
  env -u LD_PRELOAD "$bin/tools/transfer_bench" --mode=target --protocol=rdma \
    --listen_host=127.0.0.1 --rpc_port="$port" --buffer_size=$((256 << 20)) \
    >"$tmp/target.log" 2>&1 &
  pids+=($!)
  if ! wait_target_ready "$tmp/target.log" "${pids[-1]}"; then
    kill "${pids[-1]}" 2>/dev/null || true
    wait "${pids[-1]}" 2>/dev/null || true
    echo "transfer_bench $1: its target never became ready:" >&2
    tail -n 5 "$tmp/target.log" >&2
    echo nan
    return
  fi
  env -u LD_PRELOAD "$bin/tools/transfer_bench" --mode=initiator --protocol=rdma \
    --listen_host=127.0.0.1 --metadata_server="127.0.0.1:$port" \
    --segment_id=target --operation="$1" --block_size="$size" --batch_size=8 --threads=1 \
    --buffer_size=$((256 << 20)) --duration="$secs" --warmup=1 --report=json \
    >"$tmp/bench.json" 2>"$tmp/bench.err" || true
  kill "${pids[-1]}" 2>/dev/null || true
  wait "${pids[-1]}" 2>/dev/null || true
  if ! json_field "$tmp/bench.json" throughput_gbps 2>/dev/null; then
    echo "transfer_bench $1 gave no result; initiator, then target:" >&2
    tail -n 5 "$tmp/bench.err" "$tmp/target.log" >&2
    echo nan
  fi
}

pw=() pr=() fw=() fr=()
for r in $(seq "$rounds"); do
  pw+=("$(perftest_run ib_write_bw)")
  fw+=("$(bench_run write)")
  pr+=("$(perftest_run ib_read_bw)")
  fr+=("$(bench_run read)")
  echo "round $r: ib_write_bw ${pw[-1]}  transfer_bench write ${fw[-1]}  ib_read_bw ${pr[-1]}  transfer_bench read ${fr[-1]} GB/s"
done
for op in write read; do
  if [[ $op == write ]]; then p=("${pw[@]}") f=("${fw[@]}"); else p=("${pr[@]}") f=("${fr[@]}"); fi
  mp="$(median "${p[@]}")"
  mf="$(median "${f[@]}")"
  echo "median $op, 1 MiB: ib_${op}_bw $mp GB/s (range $(printf '%s\n' "${p[@]}" | sort -g | head -1)-$(printf '%s\n' "${p[@]}" | sort -g | tail -1)), transfer_bench $mf GB/s (range $(printf '%s\n' "${f[@]}" | sort -g | head -1)-$(printf '%s\n' "${f[@]}" | sort -g | tail -1)); ratio engine/perftest $(python3 -c "print('%.3f' % (float('$mf') / float('$mp')))" 2>/dev/null || echo nan)"
done
# A failed sample is reported above; the run must not look like a success.
if printf '%s\n' "${pw[@]}" "${pr[@]}" "${fw[@]}" "${fr[@]}" | grep -qx nan; then
  echo "some samples gave no result (see above)" >&2
  exit 1
fi
