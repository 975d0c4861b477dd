#!/usr/bin/env bash
# A/B (or A/B/C...) of Debian's unmodified perftest on softrnic, for the
# optimisation chapter (docs/optimisation.md): each variant is a string of
# extra perftest flags; the variants run interleaved, their order reversed
# every other round, so background load hits every variant alike. Server
# and client are two processes on softrnic0 (127.0.0.1).
#   bench/opt_perftest.sh [-r ROUNDS] [-m rate|bw|lat] TOOL "FLAGS A" "FLAGS B" ...
#   bench/opt_perftest.sh -m rate ib_write_bw "-s 64 -D 2 -I 0" "-s 64 -D 2 -I 64"
# Metrics: rate = messages/s in millions (perftest's MsgRate[Mpps]),
# bw = GB/s of 10^9 bytes (perftest prints MB/s of 2^20), lat = perftest's
# t_typical in microseconds (the _lat tools). Prints every sample, then per
# variant the median and min-max, and each median's ratio to the first
# variant's; /proc/loadavg before and after every round.
# Environment: FERRY_SOFTRNIC_PROFILE as usual; OPT_NO_BUILD=1 skips the
# build (then OPT_BIN names the -c opt bazel-bin directory).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3
metric=rate
while getopts "r:m:" o; do
  case "$o" in
    r) rounds="$OPTARG" ;;
    m) metric="$OPTARG" ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ $# -lt 3 ]]; then
  sed -n '2,16p' "$0" >&2
  exit 2
fi
tool="$1"
shift
variants=("$@")
command -v "$tool" >/dev/null || { echo "needs perftest (tools/dev.sh setup)" >&2; exit 1; }
if [[ -z "${OPT_NO_BUILD:-}" ]]; then
  t=(//transport/softrnic:libibverbs.so.1)
  bazel build -c opt "${t[@]}" >/dev/null 2>&1 || bazel build -c opt "${t[@]}"
fi
bin="${OPT_BIN:-$(bazel info -c opt bazel-bin 2>/dev/null)}"
export LD_LIBRARY_PATH="$bin/transport/softrnic"
export FERRY_SOFTRNIC_DEVICES="${FERRY_SOFTRNIC_DEVICES:-softrnic0=127.0.0.1}"
# A scratch $tmp, and $pids killed on exit.
source bench/bench_lib.sh

sample() {  # flags (one string)
  local port
  port="$(free_port)"
  # shellcheck disable=SC2086
  timeout 120 "$tool" -d softrnic0 -x 0 "${PERFTEST_SOFTRNIC[@]}" -p "$port" $1 \
    >"$tmp/server.txt" 2>&1 &
  pids+=($!)
  local listened=yes
  wait_listening "$port" "${pids[-1]}" || listened=no
  # shellcheck disable=SC2086
  timeout 120 "$tool" -d softrnic0 -x 0 "${PERFTEST_SOFTRNIC[@]}" -p "$port" $1 \
    127.0.0.1 >"$tmp/client.txt" 2>&1 ||
    kill "${pids[-1]}" 2>/dev/null || true  # else it waits for a peer for 120 s
  wait "${pids[-1]}" 2>/dev/null || true
  local line
  line="$(awk '$1 ~ /^[0-9]+$/ && NF >= 5 {l = $0} END {print l}' "$tmp/client.txt")"
  if [[ -z "$line" ]]; then
    echo "perftest failed ($tool $1; server listening on $port: $listened); client, then server:" >&2
    tail -n 5 "$tmp/client.txt" "$tmp/server.txt" >&2
    echo nan
    return
  fi
  case "$metric" in
    rate) awk '{printf "%.4f\n", $5}' <<<"$line" ;;
    bw) awk '{printf "%.4f\n", $4 * 1048576 / 1e9}' <<<"$line" ;;
    lat) awk '{printf "%.3f\n", $5}' <<<"$line" ;;
    *) echo "unknown metric $metric" >&2; exit 2 ;;
  esac
}

echo "tool $tool, metric $metric, $rounds rounds, profile ${FERRY_SOFTRNIC_PROFILE:-softrnic}, $(date -u +%F)"
run_variants sample
