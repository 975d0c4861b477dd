#!/bin/bash
# The doctor's NIC pair matrix between two hosts (network namespaces): the
# server host has two soft NICs, one on the link the client shares and one
# on a link the client has no route to; the client has one. Checks:
#   1. the reachable pair: WRITE and READ verified, latency, MTU; the pair
#      to the NIC the client cannot route to: FAIL with a fix; exit 1;
#   2. an MTU mismatch (the server on the roce-1500 profile, active MTU
#      1024; the client at 4096) is flagged with its fix.
# Needs root (ip netns). Everything it creates is removed on exit.
set -uo pipefail
RUNFILES="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}"
DOCTOR="$RUNFILES/tools/doctor"
LIBDIR="$RUNFILES/transport/softrnic"
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  echo "doctor_peer_test needs root and iproute2"
  echo "0 passed, 1 failed"
  exit 1
fi
tag="dp$$"
n=$(($$ % 200 + 20))
C="${tag}c" S="${tag}s" D="${tag}d"
CA="10.84.$n.1" SA="10.84.$n.2" SB="10.85.$n.2" DB="10.85.$n.1"
tmp="$(mktemp -d)"
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  ip netns del "$C" 2>/dev/null
  ip netns del "$S" 2>/dev/null
  ip netns del "$D" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

setup() {
  ip netns add "$C" && ip netns add "$S" && ip netns add "$D" || return 1
  ip link add eth0 netns "$C" type veth peer name eth0 netns "$S" || return 1
  ip link add eth1 netns "$S" type veth peer name eth0 netns "$D" || return 1
  ip -n "$C" addr add "$CA/24" dev eth0
  ip -n "$S" addr add "$SA/24" dev eth0
  ip -n "$S" addr add "$SB/24" dev eth1
  ip -n "$D" addr add "$DB/24" dev eth0
  local ns
  for ns in "$C" "$S" "$D"; do
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
  done
  ip -n "$S" link set eth1 up
  local _
  for _ in $(seq 50); do
    [[ $(ip -n "$S" link show | grep -c "eth[01]@.*LOWER_UP") == 2 ]] && return 0
    sleep 0.1
  done
  return 1
}
if ! setup; then
  echo "cannot create namespaces"
  echo "0 passed, 1 failed"
  exit 1
fi

passed=0 failed=0
pass() { echo "PASS: $1"; passed=$((passed + 1)); }
fail() { echo "FAIL: $1"; shift; cat "$@"; failed=$((failed + 1)); }
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

echo "$passed passed, $failed failed"
((failed == 0))
