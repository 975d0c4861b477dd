#!/bin/bash
# Runs Debian's unmodified perftest (ib_write_bw, ib_read_bw, ib_send_bw,
# ib_write_lat, ib_read_lat) on softrnic: the tools every RDMA user
# measures a fabric with. They link librdmacm and the hardware providers'
# direct-verbs libraries (libmlx5, libefa) and are bound at load
# (BIND_NOW), so every symbol those import must exist in softrnic's
# libibverbs.so.1; then each must move data between two processes. Only
# correctness is checked here: performance is measured by
# bench/bench_perftest.sh.
set -u
# shellcheck source=../../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"

LIBDIR="$RUNFILES/transport/softrnic"
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# perftest under --config=asan: the ASan runtime first.
source "$LIBDIR/asan_env.sh"
softrnic_asan_env "$LIBDIR"
((${#asan_env[@]} == 0)) || export "${asan_env[@]}"
export FERRY_SOFTRNIC_DEVICES="${FERRY_SOFTRNIC_DEVICES:-softrnic0=127.0.0.1,softrnic1=127.0.0.2}"
OUT="$tmp"
export FERRY_SOFTRNIC_SUBNET="$OUT/softrnic-subnet"

for prog in ib_write_bw ib_read_bw ib_send_bw ib_write_lat ib_read_lat; do
  command -v "$prog" >/dev/null ||
    abort "$prog not installed (apt-get install perftest; tools/dev.sh setup)"
done

# run NAME PROG ARGS...: server on softrnic1, client on softrnic0, with
# GID addressing (-x 0, RoCE) unless ADDRESSING says otherwise.
ADDRESSING=(-x 0)
# The QPs' ACK timeout: 4.096 us * 2^17 (537 ms) a try, 8 tries, as the
# doctor gives softrnic. perftest's default (2^14: 67 ms a try, 537 ms in
# all) is a hardware NIC's, which acknowledges in microseconds whatever the
# host does; softrnic acknowledges from a thread of the peer's process,
# which a loaded host was seen not to run for that long: the stress run of
# 1170bb0 failed once (ib_write_bw on mlx5-ib), and a loop beside it
# reproduced it as ib_write_lat's "Failed status 12" (IBV_WC_RETRY_EXC_ERR).
TIMEOUT=(-u 17)
run() {
  local name=$1 prog=$2
  shift 2
  local port
  port=$(free_port)
  # Line-buffered: perftest's errors (stderr) then land in the file where
  # they happened, not above a stdout flushed only at exit.
  timeout 60 stdbuf -oL -eL "$prog" -d softrnic1 "${ADDRESSING[@]}" \
    "${TIMEOUT[@]}" -p "$port" "$@" >"$OUT/$name.server" 2>&1 &
  local spid=$!
  wait_listening "$port" "$spid" 30
  timeout 60 stdbuf -oL -eL "$prog" -d softrnic0 "${ADDRESSING[@]}" \
    "${TIMEOUT[@]}" -p "$port" "$@" 127.0.0.2 >"$OUT/$name.client" 2>&1
  local crc=$?
  wait "$spid"
  local src=$?
  # The result line: the message size first, then the iterations.
  local line
  line=$(awk '$1 ~ /^[0-9]+$/ && NF >= 4 {l = $0} END {print l}' "$OUT/$name.client")
  if ((crc == 0 && src == 0)) && [[ -n "$line" ]]; then
    pass "$name: $line"
  else
    fail "$name (server exit $src, client exit $crc)"
    # Whole, not fail's tails: the reason may be anywhere (about 35 lines
    # each).
    local f
    for f in "$OUT/$name.server" "$OUT/$name.client"; do
      echo "==> $f"
      cat "$f"
    done
  fi
}

run write_bw ib_write_bw -s 65536 -n 500
run read_bw ib_read_bw -s 65536 -n 500
run send_bw ib_send_bw -s 4096 -n 500
run write_lat ib_write_lat -s 64 -n 500
run read_lat ib_read_lat -s 64 -n 500

# An InfiniBand port ("mlx5-ib"): perftest addresses the peer by its LID,
# with no GRH, as on an IB fabric.
export FERRY_SOFTRNIC_PROFILE=mlx5-ib
ADDRESSING=()
run ib_write_bw ib_write_bw -s 65536 -n 500
run ib_read_lat ib_read_lat -s 64 -n 500
unset FERRY_SOFTRNIC_PROFILE
if grep -Eq 'Link type +: IB' "$OUT/ib_write_bw.client" &&
  grep -Eq 'remote address: LID 0x[0-9a-f]*[1-9a-f]' "$OUT/ib_write_bw.client"; then
  pass "perftest saw an InfiniBand link and a peer LID"
else
  fail "perftest's header on mlx5-ib lacks 'Link type: IB' or a LID"
  head -n 25 "$OUT/ib_write_bw.client"
fi

finish
