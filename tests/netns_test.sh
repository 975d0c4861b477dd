#!/bin/bash
# Two hosts with two NICs each, on one machine: network namespaces joined
# by two veth pairs (two subnets), softrnic devices bound to the veth
# addresses, Ferry's RDMA transport between them (testing/netns_lib.sh).
# Checks, with every byte verified by transfer_bench --verify:
#   1. WRITE and READ of several block sizes between the hosts;
#   2. one link taken down in the middle of a transfer: the transfer still
#      completes over the other rail, and quickly (the port-down event
#      flushes the dead rail's QPs at once).
# Needs root (ip netns); CI and the dev machines run as root. Everything it
# creates is removed on exit. Prints "N passed, N failed".
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
BENCH="$RUNFILES/tools/transfer_bench"
LIBDIR="$RUNFILES/transport/softrnic"
# shellcheck source=../testing/netns_lib.sh
source "$RUNFILES/testing/netns_lib.sh"
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  abort "netns_test needs root and iproute2 (ip netns); run it as root"
fi

netns_begin "f$$"

netns_setup || abort "cannot create namespaces"

port=50777
in_h2 "$BENCH" --mode=target --protocol=rdma --listen_host="$B1" \
  --rpc_port="$port" --buffer_size=$((256 << 20)) --target_seconds=120 \
  >"$tmp/target.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q "target ready" "$tmp/target.log" && break; sleep 0.1; done

check_transfer() {  # name, then transfer_bench initiator flags
  local name="$1"
  shift
  if in_h1 timeout 120 "$BENCH" --mode=initiator --protocol=rdma \
      --metadata_server="$B1:$port" --listen_host="$A1" --verify \
      --buffer_size=$((256 << 20)) --threads=1 --batch_size=16 --duration=5 \
      --report=json "$@" >"$tmp/$name.json" 2>"$tmp/$name.err" &&
      grep -q '"errors":0' "$tmp/$name.json"; then
    pass "$name: $(tail -1 "$tmp/$name.json")"
  else
    fail "$name" "$tmp/$name.err" "$tmp/$name.json"
  fi
}

grep -q "target ready" "$tmp/target.log" ||
  abort "target did not start" "$tmp/target.log"

# READs first: they check the target's initial pattern, which WRITEs change.
check_transfer read_65537 --operation=read --block_size=65537 --batch_size=16 --duration=1
check_transfer read_64M --operation=read --block_size=$((64 << 20)) --batch_size=1 --duration=1
check_transfer write_1B --operation=write --block_size=1 --batch_size=64 --duration=1
check_transfer write_1M --operation=write --block_size=1048576 --batch_size=8 --duration=1

# Rail 2 goes down on host 1 in the middle of a run: both hosts' soft NICs
# see their port go down (they follow the veth's carrier), the initiator
# flushes the dead port's QPs and moves their slices to rail 1; nothing may
# fail or corrupt.
# The pull waits for the run's first progress line, so both rails carried
# traffic before it.
(for _ in $(seq 200); do
   grep -q "^\[ *[0-9.]*s," "$tmp/link_down_mid_transfer.err" 2>/dev/null && break
   sleep 0.05
 done
 netns_link_down 1 2) &
check_transfer link_down_mid_transfer --operation=write --block_size=$((4 << 20)) \
  --batch_size=4 --duration=4
# Both rails carried traffic, then the initiator saw softrnic1's port go
# down and retried its slices.
if python3 - "$tmp/link_down_mid_transfer.json" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
nics = {n["name"]: n for n in r["nics"]}
ok = (not nics["softrnic1"]["port_active"] and nics["softrnic0"]["port_active"]
      and nics["softrnic1"]["slices"] > 0 and nics["softrnic0"]["slices"] > 0
      and r["retries"] > 0)
print("nics:", r["nics"], "retries:", r["retries"])
sys.exit(0 if ok else 1)
PY
then
  pass "port down seen, slices retried on the other rail"
else
  fail "the initiator did not see the port go down or did not retry"
fi

finish
