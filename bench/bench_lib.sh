# Shared helpers of the benchmark scripts (sourced, not run). Sourcing it
# makes a scratch directory $tmp and an EXIT trap that kills every pid the
# caller adds to $pids and removes $tmp. Callers set $secs for iperf_run.

tmp="$(mktemp -d)"
pids=()
# perftest's arguments on softrnic: the QPs' ACK timeout 4.096 us * 2^17
# (537 ms) a try, as the doctor and perftest_test give softrnic. perftest's
# default (2^14: 67 ms a try, 537 ms in all) is a hardware NIC's, which
# acknowledges in microseconds whatever the host does; softrnic
# acknowledges from a thread of the peer's process, which a loaded host
# was seen not to run for that long (IBV_WC_RETRY_EXC_ERR, then perftest
# exits 1). It changes nothing while ACKs come in time.
PERFTEST_SOFTRNIC=(-u 17)

cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

# free_port, listening, wait_listening.
# shellcheck source=../testing/ports.sh
source "$(dirname "${BASH_SOURCE[0]}")/../testing/ports.sh"

# Waits for a transfer_bench target to log that it is ready: until it
# does, or until the target process (`pid`, when given) has exited, and at
# most 120 s (the targets' own lifetime). A fixed 20 s once failed a
# sample in the stress run, when a target on a loaded host came up later
# (docs/reliability.md); a slow start is reported on stderr.
wait_target_ready() {  # log [pid]
  local waited=0
  while ! grep -q "target ready" "$1" 2>/dev/null && ((waited < 1200)); do
    if [[ -n "${2:-}" ]] && ! kill -0 "$2" 2>/dev/null; then
      echo "  (the target exited before it was ready)" >&2
      return 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
  if ! grep -q "target ready" "$1" 2>/dev/null; then
    echo "  (the target was not ready after $((waited / 10)) s)" >&2
    return 1
  fi
  ((waited < 100)) || echo "  (the target took $((waited / 10)) s to be ready)" >&2
  return 0
}

# One single-stream iperf3 sample on loopback in GB/s; 1 s omitted as
# warm-up. Extra arguments go to the client (e.g. -l 1M).
iperf_run() {
  local port
  port="$(free_port)"
  iperf3 -s -1 -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
  pids+=($!)
  wait_listening "$port" "${pids[-1]}" || true
  iperf3 -c 127.0.0.1 -p "$port" -P 1 -O 1 -t "$secs" "$@" -J >"$tmp/iperf.json"
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.4f" % (d["end"]["sum_received"]["bits_per_second"]/8e9))' "$tmp/iperf.json"
}

median() {
  printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'
}

# Prints a JSON field of the last line of a file.
json_field() {
  python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])[sys.argv[2]])' "$1" "$2"
}

# Runs every variant of the array `variants` for $rounds rounds, one sample
# each per round through the function named by $1 (given the variant; its
# first word is the value), interleaved with the order reversed every other
# round so that drifting background load falls on every variant alike; the
# load average before and after each round. Then per variant the median,
# the min-max and the median's ratio to the first variant's.
run_variants() {
  local sample_fn="$1" n=${#variants[@]} r i order out m m0="" lo hi ratio
  declare -A vals
  for r in $(seq "$rounds"); do
    order=$(seq 0 $((n - 1)))
    ((r % 2 == 0)) && order=$(seq $((n - 1)) -1 0)
    echo "round $r: loadavg before $(cut -d' ' -f1-3 /proc/loadavg)"
    for i in $order; do
      out="$("$sample_fn" "${variants[$i]}")"
      vals[$i]="${vals[$i]:-} ${out%% *}"
      echo "  [$i] ${variants[$i]}: $out"
    done
    echo "round $r: loadavg after $(cut -d' ' -f1-3 /proc/loadavg)"
  done
  for i in $(seq 0 $((n - 1))); do
    # shellcheck disable=SC2086
    set -- ${vals[$i]}
    m="$(median "$@")"
    lo="$(printf '%s\n' "$@" | sort -g | head -1)"
    hi="$(printf '%s\n' "$@" | sort -g | tail -1)"
    [[ -z "$m0" ]] && m0="$m"
    ratio="$(python3 -c "print('%.3f' % ($m / $m0))" 2>/dev/null || echo nan)"
    echo "variant [$i] ${variants[$i]}: median $m (min-max $lo-$hi), ratio to [0] $ratio"
  done
}
