#!/bin/bash
# P2PHANDSHAKE mode (Mooncake's), with the real processes and no metadata
# service: a transfer_bench target prints its segment name, host:port; an
# initiator given that name as --segment_id moves verified data, over TCP
# and over RDMA (softrnic); a name that is not host:port is refused.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
BENCH="$RUNFILES/tools/transfer_bench"
LIBDIR="$RUNFILES/transport/softrnic"

for proto in tcp rdma; do
  env LD_LIBRARY_PATH="$LIBDIR" "$BENCH" --mode=target --protocol="$proto" \
    --metadata_server=P2PHANDSHAKE --listen_host=127.0.0.1 \
    --buffer_size=$((8 << 20)) --target_seconds=60 >"$tmp/t-$proto.log" 2>&1 &
  pids+=($!)
  wait_for "$tmp/t-$proto.log" "target ready"
  seg=$(sed -n 's/^target ready: segment=\([^ ]*\) .*/\1/p' "$tmp/t-$proto.log")
  if [[ $seg =~ ^127\.0\.0\.1:[0-9]+$ ]] &&
    timeout 60 env LD_LIBRARY_PATH="$LIBDIR" "$BENCH" --mode=initiator \
      --protocol="$proto" --metadata_server=P2PHANDSHAKE --segment_id="$seg" \
      --listen_host=127.0.0.1 --buffer_size=$((8 << 20)) --block_size=65536 \
      --threads=1 --batch_size=16 --duration=0.3 --verify --report=json >"$tmp/i-$proto.json" 2>&1; then
    pass "$proto: the target named itself $seg and an initiator moved verified data with no metadata service"
  else
    fail "$proto P2P (segment '$seg')" "$tmp/t-$proto.log" "$tmp/i-$proto.json"
  fi
done

timeout 60 "$BENCH" --mode=initiator --protocol=tcp \
  --metadata_server=P2PHANDSHAKE --segment_id=target --listen_host=127.0.0.1 \
  --threads=1 --batch_size=16 --duration=0.1 >"$tmp/bad.log" 2>&1
rc=$?
if ((rc != 0)) && grep -q "host:port" "$tmp/bad.log"; then
  pass "a P2P segment name that is not host:port is refused saying so"
else
  fail "bad P2P name (exit $rc)" "$tmp/bad.log"
fi

finish
