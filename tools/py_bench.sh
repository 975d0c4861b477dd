#!/bin/bash
# The Python layer against C++ on the same work, interleaved, for
# docs/performance.md: transfer_bench --mode=local (two engines in one
# process) and tools/py_bench.py (two ferry.mooncake engines in one
# process), batches of 128 x 64 KiB WRITEs over `protocol` (tcp; rdma on
# softrnic), ROUNDS rounds each; then the 8-byte synchronous call of each.
# Prints every run and the medians. Run after tools/dev.sh python.
#   tools/py_bench.sh [tcp|rdma] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
proto="${1:-tcp}"
rounds="${2:-5}"
bazel build //tools:transfer_bench //transport/softrnic:libibverbs.so.1 >/dev/null 2>&1
bin="$(bazel info bazel-bin 2>/dev/null)"
export LD_LIBRARY_PATH="$bin/transport/softrnic"
cpp=() py=() cpp8=() py8=()
for ((i = 0; i < rounds; i++)); do
  # --tcp_connections=2: the engine's default, which py_bench's engines use.
  c="$("$bin/tools/transfer_bench" --mode=local --protocol="$proto" \
    --block_size=65536 --batch_size=128 --duration=2 --tcp_connections=2 \
    --buffer_size=$((64 << 20)) --log_level=warn --report=json 2>/dev/null | tail -1)"
  p="$(/usr/bin/python3 tools/py_bench.py --protocol="$proto" --calls=2000 2>/dev/null | tail -1)"
  c8="$("$bin/tools/transfer_bench" --mode=local --protocol="$proto" \
    --block_size=8 --batch_size=1 --duration=1 --buffer_size=$((1 << 20)) \
    --tcp_connections=2 \
    --log_level=warn --report=json 2>/dev/null | tail -1)"
  echo "round $i: c++ $c"
  echo "round $i: py  $p"
  echo "round $i: c++ 8 B: $c8"
  cpp+=("$(sed -n 's/.*"throughput_gbps":\([0-9.]*\).*/\1/p' <<<"$c")")
  py+=("$(sed -n 's/.*"throughput_gbps": \([0-9.]*\).*/\1/p' <<<"$p")")
  cpp8+=("$(sed -n 's/.*"p50_us":\([0-9.]*\).*/\1/p' <<<"$c8")")
  py8+=("$(sed -n 's/.*"sync_write_8b_p50_us": \([0-9.]*\).*/\1/p' <<<"$p")")
done
/usr/bin/python3 - "${cpp[*]}" "${py[*]}" "${cpp8[*]}" "${py8[*]}" <<'PY'
import statistics, sys
c, p, c8, p8 = ([float(x) for x in a.split()] for a in sys.argv[1:])
med = statistics.median
def spread(v): return f"min {min(v)}, max {max(v)}"
print(f"128 x 64 KiB WRITE: c++ median {med(c)} GB/s ({spread(c)}); "
      f"python median {med(p)} GB/s ({spread(p)}); ratio {med(p)/med(c):.2f}")
print(f"8 B synchronous WRITE: c++ p50 median {med(c8)} us; python "
      f"transfer_sync_write p50 median {med(p8)} us; +{med(p8)-med(c8):.1f} us")
PY
