#!/usr/bin/env bash
# Handshake storm across namespaced hosts: one target host and HOSTS
# initiator hosts behind one switch (a bridge), storm_bench in each; every
# initiator host starts ENGINES/HOSTS engines, and all of them open the
# target at the same moment (--start_at) and write one block. Prints the
# time to each engine's first completed transfer over all hosts (p50, p99,
# max), failures, handshakes and QPs, and with --report=json one JSON line.
#   sudo bench/bench_storm.sh [tcp|rdma, default tcp] [ENGINES, default 1024]
#                             [HOSTS, default 16] [--report=json]
# STORM_FLAGS: more storm_bench flags for every process (split into words),
# e.g. --rpc_timeout_s=10. STORM_METADATA=standalone: a metadata_server on
# a host of its own instead of the target's embedded service.
# rdma runs on softrnic, one soft NIC per host. Needs root (ip netns).
# Removes everything it creates. OPT_NO_BUILD=1 skips the build (then
# OPT_BIN names the -c opt bazel-bin directory), as bench/opt_bench.sh.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
proto="${1:-tcp}"
engines="${2:-1024}"
hosts="${3:-16}"
report="${4:-}"
[[ $(id -u) -eq 0 ]] || { echo "needs root (ip netns)" >&2; exit 2; }
[[ "$proto" == tcp || "$proto" == rdma ]] || { echo "PROTO is tcp or rdma, not '$proto'" >&2; exit 2; }
[[ "$engines" =~ ^[1-9][0-9]*$ && "$hosts" =~ ^[1-9][0-9]*$ ]] && ((hosts <= 200)) ||
  { echo "ENGINES and HOSTS are positive numbers (HOSTS at most 200)" >&2; exit 2; }
((engines % hosts == 0)) || { echo "ENGINES must be a multiple of HOSTS" >&2; exit 2; }
if [[ -z "${OPT_NO_BUILD:-}" ]]; then
  targets=(//bench:storm_bench //tools:metadata_server //transport/softrnic:libibverbs.so.1)
  bazel build -c opt "${targets[@]}" >/dev/null 2>&1 || bazel build -c opt "${targets[@]}"
fi
bin="${OPT_BIN:-$(bazel info -c opt bazel-bin 2>/dev/null)}"
STORM="$bin/bench/storm_bench"
LIBDIR="$bin/transport/softrnic"
# shellcheck source=../testing/netns_lib.sh
source testing/netns_lib.sh
netns_begin "st$$"
per_host=$((engines / hosts))

net="10.79.$(($$ % 200 + 20))"
sw="${tag}sw"
netns_add "$sw" && netns_bridge "$sw" br0 || exit 1
host_ns() { echo "${tag}h$1"; }  # 0: the target
for ((k = 0; k <= hosts; k++)); do
  ns="$(host_ns "$k")"
  netns_add "$ns" || exit 1
  netns_port "$ns" eth0 "$sw" br0 "p$k" || exit 1
  netns_addr "$ns" eth0 "$net.$((k + 1))/24"
done
for ((k = 0; k <= hosts; k++)); do
  netns_wait_carrier "$(host_ns "$k")" eth0 1 || exit 1
done

# Run in the background only (`in_host K CMD &`): it execs, so that $! is
# the command's own pid.
in_host() {  # k, command...
  local k="$1"
  shift
  exec ip netns exec "$(host_ns "$k")" env LD_LIBRARY_PATH="$LIBDIR" \
    FERRY_SOFTRNIC_DEVICES="softrnic0=$net.$((k + 1))" FERRY_LOG_LEVEL=warn "$@"
}

# The metadata service: the target's embedded one, or (STORM_METADATA=
# standalone) a metadata_server on a host of its own, as a cluster of this
# size would run it.
metadata_flag=()
if [[ "${STORM_METADATA:-embedded}" == standalone ]]; then
  ms=$((hosts + 1))
  ns="$(host_ns "$ms")"
  netns_add "$ns" && netns_port "$ns" eth0 "$sw" br0 "p$ms" || exit 1
  netns_addr "$ns" eth0 "$net.$((ms + 1))/24"
  netns_wait_carrier "$ns" eth0 1 || exit 1
  ip netns exec "$ns" "$bin/tools/metadata_server" --listen="$net.$((ms + 1)):12050" \
    >"$tmp/ms.log" 2>&1 &
  pids+=($!)
  metadata_flag=(--metadata_server="$net.$((ms + 1)):12050")
fi
in_host 0 "$STORM" --mode=target --protocol="$proto" --listen_host="$net.1" \
  --segment_id=storm-target --initiators="$engines" "${metadata_flag[@]}" \
  ${STORM_FLAGS:-} >"$tmp/target.log" 2>&1 &
pids+=($!)
target_pid=$!
for _ in $(seq 300); do grep -q "storm target ready" "$tmp/target.log" && break; sleep 0.1; done
metadata="$(sed -n 's/^storm target ready: metadata //p' "$tmp/target.log")"
[[ -n "$metadata" ]] || { echo "the target did not come up:" >&2; tail -5 "$tmp/target.log" >&2; exit 1; }

# Every host's engines start up (not measured), then all are released at
# once: a moment far enough ahead for the slowest host's start-up.
start_at=$(($(date +%s) + 10 + engines / 40))
initiator_pids=()
for ((k = 1; k <= hosts; k++)); do
  in_host "$k" timeout 300 "$STORM" --mode=initiators --protocol="$proto" \
    --initiators="$per_host" --slot_base=$(((k - 1) * per_host)) \
    --metadata_server="$metadata" --segment_id=storm-target \
    --listen_host="$net.$((k + 1))" --start_at="$start_at" \
    --times_out="$tmp/times.$k" --report=json ${STORM_FLAGS:-} >"$tmp/h$k.json" 2>"$tmp/h$k.err" &
  pids+=($!)
  initiator_pids+=($!)
done
status=0
for p in "${initiator_pids[@]}"; do wait "$p" || status=1; done
kill -TERM "$target_pid" 2>/dev/null
wait "$target_pid" 2>/dev/null
((status == 0)) || for ((k = 1; k <= hosts; k++)); do
  grep -h "storm_bench" "$tmp/h$k.err" | head -2 >&2
done
# A host that failed without a report (killed, crashed) counts as its
# engines failed below; one that reported may still have been late.
python3 - "$tmp" "$hosts" "$proto" "$engines" "$report" <<'EOF'
import glob, json, sys
tmp, hosts, proto, engines, report = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
times, failures, rpcs, qps, late = [], 0, 0, 0, 0.0
for k in range(1, hosts + 1):
    try:
        ts = [float(x) for x in open(f"{tmp}/times.{k}")]
        j = json.loads(open(f"{tmp}/h{k}.json").read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        failures += engines // hosts  # A host that reported nothing.
        continue
    times += [t for t in ts if t >= 0]
    failures += sum(1 for t in ts if t < 0)
    late = max(late, j["late_s"])
    rpcs += j["handshake_rpcs"]
    qps += j["qps"]
try:
    qps += [json.loads(l) for l in open(f"{tmp}/target.log") if l.startswith('{"target_qps"')][-1]["target_qps"]
except (OSError, ValueError, IndexError, KeyError):
    pass
times.sort()
q = lambda p: times[min(int(p * (len(times) - 1)), len(times) - 1)] if times else 0.0
out = {"protocol": proto, "engines": engines, "hosts": hosts, "p50_s": round(q(0.5), 4),
       "p99_s": round(q(0.99), 4), "max_s": round(q(1.0), 4), "failures": failures,
       "handshake_rpcs": rpcs, "qps": qps, "late_s": late}
if report == "--report=json":
    print(json.dumps(out))
else:
    print(f"{proto}: {engines} engines on {hosts} hosts open one target at once: first "
          f"transfer done p50 {out['p50_s']:.3f} s, p99 {out['p99_s']:.3f} s, max "
          f"{out['max_s']:.3f} s; {failures} failed; {rpcs} handshakes, {qps} QPs"
          + (f"; a host was {late:.2f} s late for the start" if late else ""))
sys.exit(1 if failures or late else 0)
EOF
py=$?
((py == 0 && status == 0)) || exit 1
