#!/bin/bash
# GPU memory between two processes, as a user runs it (issue 24's "done
# when"): transfer_bench targets and initiators with --use_vram on softgpu's
# emulated GPUs, over TCP (staged through pinned host buffers on both
# sides) and over RDMA (softrnic reading device memory through dma-bufs),
# every byte verified by the initiator through the driver's copies. Also
# host memory to GPU memory across processes, and --use_vram on a host
# with no CUDA driver: a clear error, no crash.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
BENCH="$RUNFILES/tools/transfer_bench"
LIBS="$RUNFILES/gpu/softgpu:$RUNFILES/transport/softrnic"
export FERRY_SOFTGPU_DEVICES=2

# run_pair PROTO TARGET_FLAGS INITIATOR_FLAGS NAME: a target, then a verified
# WRITE run and a verified READ run against it.
run_pair() {
  local proto=$1 tflags=$2 iflags=$3 name=$4
  # shellcheck disable=SC2086
  env LD_LIBRARY_PATH="$LIBS" "$BENCH" --mode=target --protocol="$proto" \
    --metadata_server=P2PHANDSHAKE --listen_host=127.0.0.1 $tflags \
    --buffer_size=$((8 << 20)) --target_seconds=60 >"$tmp/t-$name.log" 2>&1 &
  pids+=($!)
  wait_for "$tmp/t-$name.log" "target ready"
  local seg
  seg=$(sed -n 's/^target ready: segment=\([^ ]*\) .*/\1/p' "$tmp/t-$name.log")
  for op in write read; do
    # shellcheck disable=SC2086
    if timeout 60 env LD_LIBRARY_PATH="$LIBS" "$BENCH" --mode=initiator \
      --protocol="$proto" --metadata_server=P2PHANDSHAKE --segment_id="$seg" \
      --listen_host=127.0.0.1 $iflags --buffer_size=$((8 << 20)) \
      --block_size=$((1 << 20)) --threads=2 --batch_size=2 --duration=0.3 \
      --verify --report=json >"$tmp/i-$name-$op.json" 2>&1 &&
      grep -q '"verified":true' "$tmp/i-$name-$op.json"; then
      pass "$name $op: every byte verified"
    else
      fail "$name $op" "$tmp/t-$name.log" "$tmp/i-$name-$op.json"
    fi
  done
}

run_pair tcp "--use_vram --gpu_id=1" "--use_vram --gpu_id=0" "tcp-gpu1-to-gpu0"
run_pair rdma "--use_vram --gpu_id=1" "--use_vram --gpu_id=0" "rdma-gpu1-to-gpu0"
run_pair tcp "--use_vram --gpu_id=0" "" "tcp-gpu0-to-host"

# No driver on this host (a library path that does not exist stands for
# one, even where a real driver is installed).
timeout 60 env FERRY_CUDA_LIBRARY=/nonexistent/libcuda.so.1 "$BENCH" \
  --mode=target --use_vram --metadata_server=P2PHANDSHAKE \
  --listen_host=127.0.0.1 --buffer_size=$((1 << 20)) --target_seconds=1 \
  >"$tmp/nodriver.log" 2>&1
rc=$?
if ((rc != 0 && rc < 128)) && grep -q "use_vram needs a CUDA driver" "$tmp/nodriver.log"; then
  pass "--use_vram with no CUDA driver: exit $rc, saying what is missing"
else
  fail "--use_vram with no driver (exit $rc)" "$tmp/nodriver.log"
fi

finish
