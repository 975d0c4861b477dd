#!/usr/bin/env bash
# A/B (or A/B/C...) of transfer_bench --protocol=rdma on softrnic, for the
# optimisation chapter (docs/optimisation.md). Each variant is a string:
# leading NAME=VALUE words are environment for both processes (e.g.
# FERRY_SOFTRNIC_PROFILE=cx5-roce, FERRY_SOFTRNIC_DEVICES=...), the rest are
# initiator flags, given after the common ones (the last one wins). The
# variants run interleaved, their order reversed every other round, so
# background load hits every variant alike.
#   bench/opt_bench.sh [-r ROUNDS] [-f FIELD] "VARIANT A" "VARIANT B" ...
#   bench/opt_bench.sh "--batch_size=1" "--batch_size=16" "--batch_size=128"
# Common initiator flags (OPT_FLAGS overrides): --operation=write
# --block_size=65536 --threads=1 --duration=3 --warmup=1, 256 MiB per side.
# OPT_MODE=local runs one process (--mode=local: both engines in it, the
# softrnic same-process path) instead of a target and an initiator
# (two processes over softrnic's TCP path, 127.0.0.1).
# FIELD: a field of the JSON report (throughput_gbps by default,
# transfers_per_sec, p50_us, ...). Prints every sample with its per-NIC
# slice counts, then per variant the median and min-max and each median's
# ratio to the first variant's; /proc/loadavg before and after every round.
# OPT_NO_BUILD=1 skips the build (then OPT_BIN names the -c opt bazel-bin).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3
field=throughput_gbps
# Options by hand: variants themselves start with "--".
while [[ $# -gt 0 ]]; do
  case "$1" in
    -r) rounds="$2"; shift 2 ;;
    -f) field="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [[ $# -lt 2 ]]; then
  sed -n '2,20p' "$0" >&2
  exit 2
fi
variants=("$@")
if [[ -z "${OPT_NO_BUILD:-}" ]]; then
  t=(//tools:transfer_bench //transport/softrnic:libibverbs.so.1)
  bazel build -c opt "${t[@]}" >/dev/null 2>&1 || bazel build -c opt "${t[@]}"
fi
bin="${OPT_BIN:-$(bazel info -c opt bazel-bin 2>/dev/null)}"
export LD_LIBRARY_PATH="$bin/transport/softrnic"
BENCH="$bin/tools/transfer_bench"
common="${OPT_FLAGS:---operation=write --block_size=65536 --threads=1 --duration=3 --warmup=1}"
buf=$((256 << 20))
# A scratch $tmp, and $pids killed on exit.
source bench/bench_lib.sh

sample() {  # variant string
  local envs=() flags=() w port
  for w in $1; do
    if [[ ${#flags[@]} -eq 0 && "$w" =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$w"); else flags+=("$w"); fi
  done
  envs+=("FERRY_SOFTRNIC_DEVICES=${FERRY_SOFTRNIC_DEVICES:-softrnic0=127.0.0.1}")
  # The variant's own FERRY_SOFTRNIC_DEVICES, if any, comes last and wins.
  local e
  for e in $1; do [[ "$e" == FERRY_SOFTRNIC_DEVICES=* ]] && envs+=("$e"); done
  : >"$tmp/bench.json"
  if [[ "${OPT_MODE:-two}" == local ]]; then
    # shellcheck disable=SC2086
    env "${envs[@]}" timeout 120 "$BENCH" --mode=local --protocol=rdma \
      --buffer_size="$buf" $common "${flags[@]}" --report=json \
      2>/dev/null | tail -1 >"$tmp/bench.json" || true
  else
    # The target binds a port of its own choosing and says which: a port
    # picked here first could be taken by another process meanwhile. Its
    # log is emptied here first: the redirection empties it only when the
    # child process gets to it, and until then the previous sample's
    # "target ready" (and its address) would pass for this one's.
    : >"$tmp/target.log"
    env "${envs[@]}" "$BENCH" --mode=target --protocol=rdma \
      --listen_host=127.0.0.1 --rpc_port=0 --buffer_size="$buf" \
      --target_seconds=120 >"$tmp/target.log" 2>&1 &
    pids+=($!)
    : >"$tmp/initiator.err"
    if wait_target_ready "$tmp/target.log" "${pids[-1]}"; then
      metadata="$(sed -n 's/^target ready: segment=[^ ]* metadata=//p' "$tmp/target.log")"
      # shellcheck disable=SC2086
      env "${envs[@]}" timeout 120 "$BENCH" --mode=initiator --protocol=rdma \
        --listen_host=127.0.0.1 --metadata_server="$metadata" \
        --segment_id=target --buffer_size="$buf" $common "${flags[@]}" \
        --report=json 2>"$tmp/initiator.err" | tail -1 >"$tmp/bench.json" || true
    fi
    kill "${pids[-1]}" 2>/dev/null || true
    wait "${pids[-1]}" 2>/dev/null || true
  fi
  if ! grep -q '{' "$tmp/bench.json"; then
    # No report: what each side said, so that the failure explains itself.
    echo "  (no report; the target's log, then the initiator's:)" >&2
    tail -n 5 "$tmp/target.log" "$tmp/initiator.err" 2>/dev/null | sed 's/^/    /' >&2
  fi
  python3 - "$tmp/bench.json" "$field" <<'EOF'
import json, sys
try:
    d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception:
    print("nan (no report)")
    sys.exit(0)
nics = " ".join("%s:%d" % (n["name"], n["slices"]) for n in d.get("nics", []))
print("%s errors=%d slices[%s]" % (d[sys.argv[2]], d.get("errors", 0), nics))
EOF
}

echo "transfer_bench ${OPT_MODE:-two}-process, field $field, $rounds rounds, common: $common, $(date -u +%F)"
run_variants sample
