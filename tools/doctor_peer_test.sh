#!/bin/bash
# The doctor's NIC pair matrix between two hosts (network namespaces): the
# server host has two soft NICs, one on the link the client shares and one
# on a link the client has no route to; the client has one. Checks:
#   1. the reachable pair: WRITE and READ verified, latency, MTU; the pair
#      to the NIC the client cannot route to: FAIL with a fix; exit 1;
#   2. an MTU mismatch (the server on the roce-1500 profile, active MTU
#      1024; the client at 4096) is flagged with its fix;
#   3. the same matrix against a running engine on the server host, found
#      by its segment name through its embedded metadata service
#      (--metadata, --peer=SEGMENT): the reachable pair verified on the
#      engine's probe page, the unroutable one FAIL; the engine closed
#      every rail the doctor opened and still moves verified data; an
#      engine whose RPC address cannot be reached is one FAIL, not a wait
#      per pair; an unknown segment fails with its fix.
# Needs root (ip netns). Everything it creates is removed on exit.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
DOCTOR="$RUNFILES/tools/doctor"
BENCH="$RUNFILES/tools/transfer_bench"
LIBDIR="$RUNFILES/transport/softrnic"
# shellcheck source=../testing/netns_lib.sh
source "$RUNFILES/testing/netns_lib.sh"
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  abort "doctor_peer_test needs root and iproute2"
fi
# The namespaces, and the processes in them, removed on exit.
netns_begin "dp$$"
n=$(($$ % 200 + 20))
C="${tag}c" S="${tag}s" D="${tag}d"
CA="10.84.$n.1" SA="10.84.$n.2" SB="10.85.$n.2" DB="10.85.$n.1"

# The client C and the server S share a link; S's second link goes to D,
# to which C has no route.
setup() {
  netns_add "$C" && netns_add "$S" && netns_add "$D" || return 1
  netns_link "$C" eth0 "$S" eth0 || return 1
  netns_link "$S" eth1 "$D" eth0 || return 1
  netns_addr "$C" eth0 "$CA/24"
  netns_addr "$S" eth0 "$SA/24"
  netns_addr "$S" eth1 "$SB/24"
  netns_addr "$D" eth0 "$DB/24"
  netns_wait_carrier "$S" "eth[01]" 2
}
setup || abort "cannot create namespaces"

json() {
  python3 - "$1" "$2" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
c = {x["name"]: x for x in r["checks"]}
sys.exit(0 if eval("(" + sys.argv[2] + ")") else 1)
PY
}

serve() {  # extra env assignments for the server, then its log name
  local log=$1
  shift
  (exec ip netns exec "$S" env LD_LIBRARY_PATH="$LIBDIR" \
    FERRY_SOFTRNIC_DEVICES="softrnic0=$SA,softrnic1=$SB" "$@" \
    "$DOCTOR" --serve=17700 --serve_seconds=60) >"$tmp/$log" 2>&1 &
  pids+=($!)
  local _
  for _ in $(seq 100); do grep -q "doctor serving" "$tmp/$log" && return 0; sleep 0.1; done
  return 1
}
probe() {  # report file
  ip netns exec "$C" env LD_LIBRARY_PATH="$LIBDIR" \
    FERRY_SOFTRNIC_DEVICES="softrnic0=$CA" timeout 60 \
    "$DOCTOR" --json --peer="$SA:17700" >"$tmp/$1" 2>"$tmp/$1.err"
}

serve s1.log env || fail "server did not start" "$tmp/s1.log"
probe matrix.json
rc=$?
if ((rc == 1)) && json "$tmp/matrix.json" \
    'c["peer softrnic0 -> softrnic0"]["level"] == "OK"
     and "verified" in c["peer softrnic0 -> softrnic0"]["detail"]
     and c["peer softrnic0 -> softrnic1"]["level"] == "FAIL"
     and "route" in c["peer softrnic0 -> softrnic1"]["fix"]'; then
  pass "reachable pair verified; the unroutable NIC fails, with a fix: $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print([c[\"detail\"] for c in r[\"checks\"] if c[\"name\"]==\"peer softrnic0 -> softrnic1\"][0])" "$tmp/matrix.json")"
else
  fail "pair matrix (exit $rc)" "$tmp/matrix.json" "$tmp/matrix.json.err"
fi
kill "${pids[-1]}" 2>/dev/null; wait "${pids[-1]}" 2>/dev/null

serve s2.log env FERRY_SOFTRNIC_PROFILE=roce-1500 ||
  fail "server did not start" "$tmp/s2.log"
probe mtu.json
rc=$?
if ((rc == 1)) && json "$tmp/mtu.json" \
    'c["peer softrnic0 -> softrnic0"]["level"] == "FAIL"
     and "MTU 4096 here, 1024 there" in c["peer softrnic0 -> softrnic0"]["detail"]
     and "MTU mismatch" in c["peer softrnic0 -> softrnic0"]["fix"]'; then
  pass "an MTU mismatch is flagged, with the fix"
else
  fail "MTU mismatch (exit $rc)" "$tmp/mtu.json" "$tmp/mtu.json.err"
fi

# 3. A running engine, by segment name.
engine() {  # segment, advertised address, RPC port (log: $tmp/<segment>.log)
  (exec ip netns exec "$S" env LD_LIBRARY_PATH="$LIBDIR" \
    FERRY_SOFTRNIC_DEVICES="softrnic0=$SA,softrnic1=$SB" \
    "$BENCH" --mode=target --protocol=rdma --segment_id="$1" \
    --local_server_name="$1" --advertise_host="$2" --rpc_port="$3" \
    --buffer_size=$((16 << 20)) --target_seconds=60) >"$tmp/$1.log" 2>&1 &
  pids+=($!)
  local _
  for _ in $(seq 100); do grep -q "target ready" "$tmp/$1.log" && return 0; sleep 0.1; done
  return 1
}
engine engine "$SA" 17701 || fail "engine did not start" "$tmp/engine.log"
segment_probe() {  # report file, segment
  ip netns exec "$C" env LD_LIBRARY_PATH="$LIBDIR" \
    FERRY_SOFTRNIC_DEVICES="softrnic0=$CA" timeout 60 \
    "$DOCTOR" --json --metadata="$SA:17701" --peer="$2" >"$tmp/$1" 2>"$tmp/$1.err"
}
segment_probe engine.json engine
rc=$?
if ((rc == 1)) && json "$tmp/engine.json" \
    'c["segment engine"]["level"] == "OK"
     and "2 with a probe page" in c["segment engine"]["detail"]
     and c["peer softrnic0 -> softrnic0"]["level"] == "OK"
     and "verified" in c["peer softrnic0 -> softrnic0"]["detail"]
     and c["peer softrnic0 -> softrnic1"]["level"] == "FAIL"
     and "route" in c["peer softrnic0 -> softrnic1"]["fix"]'; then
  pass "a running engine by segment name: reachable pair verified, the unroutable NIC fails"
else
  fail "segment probe (exit $rc)" "$tmp/engine.json" "$tmp/engine.json.err" "$tmp/engine.log"
fi
# The engine answered both connects and took both rails down again.
connected=$(grep -c "connected to 'doctor@" "$tmp/engine.log")
closed=$(grep -c "rail to 'doctor@.*closed by the peer" "$tmp/engine.log")
if ((connected == 2 && closed == 2)); then
  pass "the engine connected the doctor's 2 rails and closed both"
else
  fail "the doctor's rails: $connected connected, $closed closed" "$tmp/engine.log"
fi
if ip netns exec "$S" env LD_LIBRARY_PATH="$LIBDIR" \
  FERRY_SOFTRNIC_DEVICES="softrnic0=$SA" timeout 60 \
  "$BENCH" --mode=initiator --protocol=rdma --metadata_server="$SA:17701" \
  --segment_id=engine --buffer_size=$((16 << 20)) --threads=1 \
  --batch_size=16 --duration=1 --verify \
  >"$tmp/after.log" 2>&1; then
  pass "the engine still moves verified data after the doctor"
else
  fail "a transfer after the doctor" "$tmp/after.log" "$tmp/engine.log"
fi
# An engine whose advertised RPC address the client cannot reach: one
# FAIL with the fix, and no waiting out every other pair.
engine hidden "$SB" 17702 || fail "engine did not start" "$tmp/hidden.log"
start=$(date +%s)
ip netns exec "$C" env LD_LIBRARY_PATH="$LIBDIR" \
  FERRY_SOFTRNIC_DEVICES="softrnic0=$CA" timeout 60 \
  "$DOCTOR" --json --metadata="$SA:17702" --peer=hidden >"$tmp/hidden.json" 2>"$tmp/hidden.json.err"
rc=$?
took=$(($(date +%s) - start))
if ((rc == 1 && took < 30)) && json "$tmp/hidden.json" \
    'c["peer softrnic0 -> softrnic0"]["level"] == "FAIL"
     and "RPC address" in c["peer softrnic0 -> softrnic0"]["fix"]
     and "not probed" in c["peer"]["detail"]
     and "peer softrnic0 -> softrnic1" not in c'; then
  pass "an engine whose RPC address is unreachable: one FAIL with the fix, the rest skipped (${took} s)"
else
  fail "unreachable RPC address (exit $rc, ${took} s)" "$tmp/hidden.json" "$tmp/hidden.json.err" "$tmp/hidden.log"
fi

segment_probe nosuch.json no-such-segment
rc=$?
if ((rc == 1)) && json "$tmp/nosuch.json" \
    'c["segment no-such-segment"]["level"] == "FAIL"
     and "--metadata" in c["segment no-such-segment"]["fix"]'; then
  pass "an unknown segment fails, with the fix"
else
  fail "unknown segment (exit $rc)" "$tmp/nosuch.json" "$tmp/nosuch.json.err"
fi

finish
