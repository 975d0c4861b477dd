#!/usr/bin/env bash
# The real-GPU check (issue 24): Ferry's GPU path on a machine with an
# NVIDIA GPU and no RDMA NIC, in at most 8 minutes. Two steps:
#
#   devtools/gpu_check.sh bundle [DIR]   # here: -c opt binaries, with
#                                        # every shared library they load
#                                        # (glibc's loader too), into DIR
#                                        # (gpu-check/)
#   DIR/gpu_check.sh run [OUT]           # there: the checks; report in OUT
#
# The machine is not Debian 12, so the bundle carries its own loader and
# libraries and runs each program through them; only NVIDIA's
# libcuda.so.1 comes from the machine (Ferry loads it at run time). On
# real cudaMalloc'd memory (cuMemAlloc) it runs:
#   1. the doctor's GPU report (driver, GPUs, dma-buf / peermem);
#   2. the driver's copy rates, host<->device and device<->device
#      (gpu_copy_bench): the references;
#   3. TCP between two processes, GPU to GPU (staged through pinned
#      buffers on both sides), WRITE and READ, every byte verified, beside
#      host to host over TCP in the same run;
#   4. softrnic from device memory to a host-memory target (RDMA through
#      the emulated NIC; the initiator's GPU memory is registered through
#      a dma-buf where the NIC takes it, else staged through host memory);
#   5. GPU to GPU with rdma,tcp on both sides: the target's GPU memory
#      goes over RDMA where its NIC registered it, else over TCP (per
#      buffer). softrnic is the CPU, so it cannot import a real GPU's
#      dma-buf: on a real GPU this is the TCP fallback, and the doctor's
#      "GPU memory on the NICs" line says so.
# Each step's outcome and figures go to OUT/report.md; the exit status is
# non-zero if a transfer failed verification.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

bundle() {
  local dir="${1:-gpu-check}"
  cd "$here/.."
  bazel build -c opt //tools:transfer_bench //bench:gpu_copy_bench \
    //tools:doctor //transport/softrnic:libibverbs.so.1 >&2 || return 1
  local bin
  bin="$(bazel info -c opt bazel-bin 2>/dev/null)"
  rm -rf "$dir"
  mkdir -p "$dir/bin" "$dir/lib" "$dir/softrnic"
  cp "$bin/tools/transfer_bench" "$bin/bench/gpu_copy_bench" \
    "$bin/tools/doctor" "$dir/bin/"
  cp "$bin/transport/softrnic/libibverbs.so.1" "$dir/softrnic/"
  # Every library the programs load, glibc's included, and the loader.
  local f lib
  for f in "$dir"/bin/* "$dir/softrnic/libibverbs.so.1"; do
    while read -r lib; do
      [[ -n "$lib" && -f "$lib" ]] || continue
      [[ "$(basename "$lib")" == libibverbs.so.1 ]] && continue
      cp -L "$lib" "$dir/lib/"
    done < <(ldd "$f" | awk '/=> \// {print $3} /^\t\/.*ld-linux/ {print $1}')
  done
  cp "$0" "$dir/gpu_check.sh"
  # run-prog NAME ARGS...: a bundled program through the bundled loader
  # (a script, so that timeout can run it).
  cat >"$dir/run-prog" <<'WRAP'
#!/bin/sh
d="$(cd "$(dirname "$0")" && pwd)"
p="$1"
shift
exec "$d/lib/ld-linux-x86-64.so.2" \
  --library-path "${GPU_CHECK_LIBPATH:-$d/softrnic:$d/lib}" "$d/bin/$p" "$@"
WRAP
  chmod +x "$dir/gpu_check.sh" "$dir/run-prog"
  du -sh "$dir" >&2
}


# The median of the "throughput_gbps" of JSON report lines in files.
gbps() { python3 -c '
import json, sys, statistics
v = []
for f in sys.argv[1:]:
    for l in open(f):
        if l.startswith("{"):
            v.append(json.loads(l)["throughput_gbps"])
print(f"{statistics.median(v):.2f} (rounds: " + ", ".join(f"{x:.2f}" for x in v) + ")" if v else "none")
' "$@" 2>/dev/null || echo "?"; }

# pair PROTO TFLAGS IFLAGS NAME: a target and verified WRITE and READ runs
# (3 rounds each) against it. Sets failures.
pair() {
  local proto=$1 tflags=$2 iflags=$3 name=$4 op r
  # Files are named by a slug of the name (no spaces or parentheses, so
  # that they come back from a lent machine).
  local slug
  slug="$(echo "$name" | tr -c 'A-Za-z0-9\n' '-' | tr -s '-')"
  # shellcheck disable=SC2086
  timeout 120 "$here/run-prog" transfer_bench --mode=target --protocol="$proto" \
    --metadata_server=P2PHANDSHAKE --listen_host=127.0.0.1 $tflags \
    --buffer_size=$((256 << 20)) --target_seconds=100 \
    >"$OUT/t-$slug.log" 2>&1 &
  local tpid=$!
  for _ in $(seq 200); do
    grep -q "target ready" "$OUT/t-$slug.log" && break
    sleep 0.1
  done
  local seg
  seg=$(sed -n 's/^target ready: segment=\([^ ]*\) .*/\1/p' "$OUT/t-$slug.log")
  if [[ -z "$seg" ]]; then
    echo "| $name | target did not start: $(tail -2 "$OUT/t-$slug.log" | tr '\n' ' ') | | |" >>"$OUT/report.md"
    failures=$((failures + 1))
    kill "$tpid" 2>/dev/null
    return
  fi
  local cells=()
  for op in write read; do
    for r in 1 2 3; do
      # shellcheck disable=SC2086
      timeout 60 "$here/run-prog" transfer_bench --mode=initiator \
        --protocol="$proto" --metadata_server=P2PHANDSHAKE \
        --segment_id="$seg" --listen_host=127.0.0.1 $iflags \
        --buffer_size=$((256 << 20)) --block_size=$((1 << 20)) --threads=4 \
        --batch_size=16 --duration=4 --verify --report=json \
        >"$OUT/i-$slug-$op-$r.json" 2>"$OUT/i-$slug-$op-$r.err"
      if ! grep -q '"verified":true' "$OUT/i-$slug-$op-$r.json"; then
        failures=$((failures + 1))
        echo "$name $op round $r: not verified: $(tail -3 "$OUT/i-$slug-$op-$r.err" | tr '\n' ' ')" >>"$OUT/errors.txt"
      fi
    done
    cells+=("$(gbps "$OUT"/i-"$slug"-"$op"-*.json)")
  done
  kill "$tpid" 2>/dev/null
  wait "$tpid" 2>/dev/null
  echo "| $name | ${cells[0]} | ${cells[1]} |" >>"$OUT/report.md"
}

run() {
  OUT="${1:-$here/out}"
  mkdir -p "$OUT"
  # softrnic's libibverbs first: the programs load one even over TCP.
  export GPU_CHECK_LIBPATH="$here/softrnic:$here/lib"
  failures=0
  # NVIDIA's driver, from the machine ($FERRY_CUDA_LIBRARY wins: softgpu's
  # to try the bundle where there is no GPU).
  local cuda="${FERRY_CUDA_LIBRARY:-}"
  [[ -n "$cuda" ]] ||
    cuda="$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}')"
  for c in "$cuda" /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 \
    /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/wsl/lib/libcuda.so.1; do
    [[ -n "$c" && -e "$c" ]] && cuda="$c" && break
  done
  export FERRY_CUDA_LIBRARY="$cuda"
  {
    echo "# Ferry real-GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
    echo
    echo "Host: $(uname -srm); $(nproc) cores; driver library: ${cuda:-none found}"
    command -v nvidia-smi >/dev/null &&
      nvidia-smi --query-gpu=name,pci.bus_id,driver_version,memory.total \
        --format=csv,noheader | sed 's/^/GPU: /'
    echo
    echo "## doctor (GPU part)"
    echo
    echo '```'
  } >"$OUT/report.md"
  # softrnic stands in for the NIC the machine lacks.
  FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 timeout 60 "$here/run-prog" doctor --register_bytes=$((1 << 20)) 2>&1 |
    grep -E "CUDA driver|GPUs|GPUDirect|GPU memory on|GPU-NIC|fix:" >>"$OUT/report.md"
  {
    echo '```'
    echo
    echo "## The driver's copies (gpu_copy_bench, GB/s)"
    echo
    echo '```'
  } >>"$OUT/report.md"
  timeout 120 "$here/run-prog" gpu_copy_bench \
    --benchmark_filter='/(1048576|67108864)$' --benchmark_min_time=0.5 \
    --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    2>&1 | grep -E "_median|^Benchmark" >>"$OUT/report.md"
  {
    echo '```'
    echo
    echo "## Transfers between two processes, 1 MiB blocks, 16 x 4, verified"
    echo
    echo "GB/s, median of 3 rounds of 4 s."
    echo
    echo "| memory, transport | WRITE | READ |"
    echo "| --- | --- | --- |"
  } >>"$OUT/report.md"
  pair tcp "" "" "host -> host, tcp"
  pair tcp "--use_vram --gpu_id=0" "--use_vram --gpu_id=0" "GPU -> GPU, tcp (staged)"
  FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 pair rdma "" "--use_vram --gpu_id=0" \
    "GPU -> host, softrnic"
  FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 pair rdma,tcp "--use_vram --gpu_id=0" \
    "--use_vram --gpu_id=0" "GPU -> GPU, rdma,tcp"
  {
    echo
    if ((failures > 0)); then
      echo "## Failures: $failures"
      echo
      [[ -s "$OUT/errors.txt" ]] && sed 's/^/- /' "$OUT/errors.txt"
    else
      echo "Every byte of every run verified."
    fi
  } >>"$OUT/report.md"
  cat "$OUT/report.md"
  ((failures == 0))
}

case "${1:-}" in
  bundle) shift; bundle "$@" ;;
  run) shift; run "$@" ;;
  *)
    echo "usage: devtools/gpu_check.sh bundle [DIR] | DIR/gpu_check.sh run [OUT]" >&2
    exit 2
    ;;
esac
