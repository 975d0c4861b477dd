#!/bin/bash
# Two hosts with two NICs each, on one machine: network namespaces h1 and h2
# joined by two veth pairs (two subnets), softrnic devices bound to the veth
# addresses, Ferry's RDMA transport between them. Checks, with every byte
# verified by transfer_bench --verify:
#   1. WRITE and READ of several block sizes between the hosts;
#   2. one link taken down in the middle of a transfer: the transfer still
#      completes over the other rail.
# Needs root (ip netns); CI and the dev machines run as root. Everything it
# creates is removed on exit. Prints "N passed, N failed".
set -uo pipefail

RUNFILES="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}"
BENCH="$RUNFILES/tools/transfer_bench"
LIBDIR="$RUNFILES/transport/softrnic"
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  echo "netns_test needs root and iproute2 (ip netns); run it as root"
  echo "0 passed, 1 failed"
  exit 1
fi

tag="f$$"
n=$(( $$ % 200 + 20 ))
H1="${tag}h1"
H2="${tag}h2"
A1="10.77.$n.1" B1="10.77.$n.2"   # Rail 0
A2="10.78.$n.1" B2="10.78.$n.2"   # Rail 1
tmp="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  ip netns del "$H1" 2>/dev/null
  ip netns del "$H2" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

ip netns add "$H1" && ip netns add "$H2" || { echo "cannot create namespaces"; echo "0 passed, 1 failed"; exit 1; }
for i in 1 2; do
  ip link add "${tag}a$i" netns "$H1" type veth peer name "${tag}b$i" netns "$H2"
done
ip -n "$H1" addr add "$A1/24" dev "${tag}a1"
ip -n "$H1" addr add "$A2/24" dev "${tag}a2"
ip -n "$H2" addr add "$B1/24" dev "${tag}b1"
ip -n "$H2" addr add "$B2/24" dev "${tag}b2"
for ns in "$H1" "$H2"; do
  ip -n "$ns" link set lo up
  for l in $(ip -n "$ns" -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$tag"); do
    ip -n "$ns" link set "$l" up
  done
done

in_h1() { ip netns exec "$H1" env LD_LIBRARY_PATH="$LIBDIR" \
  FERRY_SOFTRNIC_DEVICES="softrnic0=$A1,softrnic1=$A2" "$@"; }
in_h2() { ip netns exec "$H2" env LD_LIBRARY_PATH="$LIBDIR" \
  FERRY_SOFTRNIC_DEVICES="softrnic0=$B1,softrnic1=$B2" "$@"; }

port=50777
in_h2 "$BENCH" --mode=target --protocol=rdma --listen_host="$B1" \
  --rpc_port="$port" --buffer_size=$((256 << 20)) --target_seconds=120 \
  >"$tmp/target.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q "target ready" "$tmp/target.log" && break; sleep 0.1; done

passed=0 failed=0
check() {  # name, then transfer_bench initiator flags
  local name="$1"
  shift
  if in_h1 timeout 120 "$BENCH" --mode=initiator --protocol=rdma \
      --metadata_server="$B1:$port" --listen_host="$A1" --verify \
      --buffer_size=$((256 << 20)) --report=json "$@" >"$tmp/$name.json" 2>"$tmp/$name.err" &&
      grep -q '"errors":0' "$tmp/$name.json"; then
    echo "PASS: $name: $(tail -1 "$tmp/$name.json")"
    passed=$((passed + 1))
  else
    echo "FAIL: $name"
    tail -n 5 "$tmp/$name.err" "$tmp/$name.json"
    failed=$((failed + 1))
  fi
}

if ! grep -q "target ready" "$tmp/target.log"; then
  echo "FAIL: target did not start"; cat "$tmp/target.log"
  echo "0 passed, 1 failed"
  exit 1
fi

# READs first: they check the target's initial pattern, which WRITEs change.
check read_65537 --operation=read --block_size=65537 --batch_size=16 --duration=1
check read_64M --operation=read --block_size=$((64 << 20)) --batch_size=1 --duration=1
check write_1B --operation=write --block_size=1 --batch_size=64 --duration=1
check write_1M --operation=write --block_size=1048576 --batch_size=8 --duration=1

# Rail 1 goes down in the middle of a run: its slices time out (softrnic
# RETRY_EXC_ERR) and are retried on rail 0; nothing may fail or corrupt.
(sleep 1; ip -n "$H1" link set "${tag}a2" down) &
check link_down_mid_transfer --operation=write --block_size=$((4 << 20)) \
  --batch_size=4 --duration=4

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
