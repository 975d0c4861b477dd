#!/bin/bash
# The Python layer against C++ on the same work, interleaved, for
# docs/python.md: batches of 128 x 64 KiB WRITEs over `protocol` (tcp;
# rdma on softrnic) by transfer_bench and by bench/py_bench.py
# (ferry.mooncake), ROUNDS rounds each; then the 8-byte synchronous call of
# each. Prints every run and the medians. Run after tools/dev.sh python.
#   bench/py_bench.sh [tcp|rdma] [rounds] [two-process|local]
# two-process (default): one target process (transfer_bench --mode=target,
#   P2PHANDSHAKE), which each initiator process (transfer_bench
#   --mode=initiator, or py_bench.py --target) drives in turn: prefill and
#   decode are two processes.
# local: two engines in the initiator's process (transfer_bench
#   --mode=local; py_bench.py without --target).
set -euo pipefail
cd "$(dirname "$0")/.."
proto="${1:-tcp}"
rounds="${2:-5}"
layout="${3:-two-process}"
bazel build -c opt //tools:transfer_bench //transport/softrnic:libibverbs.so.1 >/dev/null 2>&1
bin="$(bazel info -c opt bazel-bin 2>/dev/null)"
export LD_LIBRARY_PATH="$bin/transport/softrnic"
# --tcp_connections=2: the engine's default, which py_bench's engines use.
common=(--protocol="$proto" --tcp_connections=2 --threads=1 --log_level=warn
  --report=json)
big=$((64 << 20))
work="$(mktemp -d)"
target_pid=""
cleanup() {
  [[ -n "$target_pid" ]] && kill "$target_pid" 2>/dev/null && wait "$target_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

case "$layout" in
  two-process)
    "$bin/tools/transfer_bench" --mode=target --metadata_server=P2PHANDSHAKE \
      --local_server_name=127.0.0.1 --protocol="$proto" --buffer_size="$big" \
      --target_seconds=$((rounds * 15 + 30)) >"$work/target.log" 2>&1 &
    target_pid=$!
    seg=""
    for ((i = 0; i < 100; i++)); do
      seg="$(sed -n 's/^target ready: segment=\([^ ]*\).*/\1/p' "$work/target.log")"
      [[ -n "$seg" ]] && break
      kill -0 "$target_pid" 2>/dev/null || break
      sleep 0.1
    done
    if [[ -z "$seg" ]]; then
      echo "py_bench: the target did not start:" >&2
      cat "$work/target.log" >&2
      exit 1
    fi
    cpp_run=("$bin/tools/transfer_bench" --mode=initiator
      --metadata_server=P2PHANDSHAKE --segment_id="$seg" "${common[@]}")
    py_run=(/usr/bin/python3 bench/py_bench.py --protocol="$proto" --target="$seg")
    ;;
  local)
    cpp_run=("$bin/tools/transfer_bench" --mode=local "${common[@]}")
    py_run=(/usr/bin/python3 bench/py_bench.py --protocol="$proto")
    ;;
  *)
    echo "usage: bench/py_bench.sh [tcp|rdma] [rounds] [two-process|local]" >&2
    exit 2
    ;;
esac

cpp=() py=() cpp8=() py8=()
for ((i = 0; i < rounds; i++)); do
  c="$("${cpp_run[@]}" --block_size=65536 --batch_size=128 --duration=2 \
    --buffer_size="$big" 2>/dev/null | tail -1)"
  p="$("${py_run[@]}" --calls=2000 2>/dev/null | tail -1)"
  c8="$("${cpp_run[@]}" --block_size=8 --batch_size=1 --duration=1 \
    --buffer_size=$((1 << 20)) 2>/dev/null | tail -1)"
  echo "round $i: c++ $c"
  echo "round $i: py  $p"
  echo "round $i: c++ 8 B: $c8"
  cpp+=("$(sed -n 's/.*"throughput_gbps":\([0-9.]*\).*/\1/p' <<<"$c")")
  py+=("$(sed -n 's/.*"throughput_gbps": \([0-9.]*\).*/\1/p' <<<"$p")")
  cpp8+=("$(sed -n 's/.*"p50_us":\([0-9.]*\).*/\1/p' <<<"$c8")")
  py8+=("$(sed -n 's/.*"sync_write_8b_p50_us": \([0-9.]*\).*/\1/p' <<<"$p")")
done
/usr/bin/python3 - "$proto" "$layout" "${cpp[*]}" "${py[*]}" "${cpp8[*]}" "${py8[*]}" <<'PY'
import statistics, sys
proto, layout = sys.argv[1:3]
c, p, c8, p8 = ([float(x) for x in a.split()] for a in sys.argv[3:])
def med(v): return round(statistics.median(v), 3)
def spread(v): return f"min {min(v)}, max {max(v)}"
print(f"{proto}, {layout}, {len(c)} rounds")
print(f"128 x 64 KiB WRITE: c++ median {med(c)} GB/s ({spread(c)}); "
      f"python median {med(p)} GB/s ({spread(p)}); ratio {med(p)/med(c):.2f}")
print(f"8 B synchronous WRITE: c++ p50 median {med(c8)} us; python "
      f"transfer_sync_write p50 median {med(p8)} us; +{med(p8)-med(c8):.1f} us")
PY
