#!/bin/bash
# softrnic's ACK timer on a link slower than its timeout allows for: two
# namespaced hosts joined by a veth link shaped to 40 Mbit/s (5 MB/s) with
# tc, bench/verbs_bench keeping eight 1 MiB RDMA WRITEs in flight on one
# RC QP (ACK timeout 4.096 us * 2^14 = 67 ms, plus softrnic's allowance of
# 105 ms for a 1 MiB message). Each message needs about 210 ms on this
# link, and the socket holds the ones behind it: a timer that ran from
# when a frame entered the socket expired on frames that were only queued
# and resent them (go-back-N, into the same stream), so the link carried
# copies. The timer waits while the connection keeps moving the frame's
# bytes, as a NIC's runs from transmission: no ACK timeout may fire here.
# Needs root (ip netns, tc); not being root is a failure, not a skip.
# Prints "N passed, N failed".
set -uo pipefail
# shellcheck source=../../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
# shellcheck source=../../testing/netns_lib.sh
source "$RUNFILES/testing/netns_lib.sh"
BENCH="$RUNFILES/bench/verbs_bench"
LIBDIR="$RUNFILES/transport/softrnic"

if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  abort "needs root and iproute2 (ip netns, tc): run this test as root"
fi
netns_begin "sl$$"
netns_setup || abort "could not set up the namespaced hosts"
netns_shape 40mbit
H1_DEVICES="softrnic0=$A1" H2_DEVICES="softrnic0=$B1"
port="$(free_port)"
in_h2 timeout 60 "$BENCH" --role=server --host="$B1" --port="$port" \
  >"$tmp/server.log" 2>&1 &
pids+=($!)
out="$(in_h1 timeout 60 "$BENCH" --role=client --host="$B1" --port="$port" \
  --size=$((1 << 20)) --window=8 --warmup=0.5 --duration=2 2>"$tmp/client.err")"
rc=$?
echo "client: $out (exit $rc)"
if ((rc != 0)); then
  fail "verbs_bench over the shaped link exited $rc" "$tmp/client.err" "$tmp/server.log"
else
  read -r gbps timeouts < <(python3 -c '
import json, sys
d = json.loads(sys.argv[1].splitlines()[-1])
print(d["throughput_gbps"], d["ack_timeouts"])' "$out")
  if python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) > 0 else 1)' "$gbps"; then
    pass "1 MiB WRITEs flowed over a 40 Mbit/s link ($gbps GB/s)"
  else
    fail "no throughput over the shaped link" "$tmp/client.err"
  fi
  if [[ "$timeouts" == 0 ]]; then
    pass "no ACK timeout fired while the frames were only queued"
  else
    fail "$timeouts ACK timeouts (go-back-N resends) on a link that lost nothing"
  fi
fi
finish
