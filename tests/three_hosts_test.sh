#!/bin/bash
# Three hosts on one machine, each a network namespace with its own address
# on one switch (a bridge in a fourth namespace): the metadata server on
# host M, a target on host T, an initiator on host I. Each engine is
# started with the flags a user passes on a real cluster, nothing more:
#   - Mooncake's: --local_server_name=<this host's IP>:<port>;
#   - none at all: the engine binds every interface and advertises its
#     first RDMA NIC's address (rdma) or the host's primary address (tcp).
# Every run moves verified bytes (transfer_bench --verify), over TCP and
# over RDMA (softrnic NICs bound to each host's address). A target that
# advertises loopback must make the initiator fail at once with an error
# that says so, not retry.
# Needs root (ip netns). Everything it creates is removed on exit. Prints
# "N passed, N failed".
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
BENCH="$RUNFILES/tools/transfer_bench"
MDS="$RUNFILES/tools/metadata_server"
LIBDIR="$RUNFILES/transport/softrnic"
# shellcheck source=../testing/netns_lib.sh
source "$RUNFILES/testing/netns_lib.sh"
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  abort "three_hosts_test needs root and iproute2 (ip netns)"
fi

# The namespaces, and the processes in them, removed on exit.
netns_begin "t3$$"
n=$(($$ % 200 + 20))
SW="${tag}sw"
declare -A IP=([m]="10.79.$n.1" [t]="10.79.$n.2" [i]="10.79.$n.3")

setup() {
  netns_add "$SW" && netns_bridge "$SW" br0 || return 1
  local h
  for h in m t i; do
    netns_add "${tag}$h" || return 1
    netns_port "${tag}$h" eth0 "$SW" br0 "p$h" || return 1
    netns_addr "${tag}$h" eth0 "${IP[$h]}/24"
  done
  netns_wait_carrier "$SW" "p[mti]" 3
}

on() {  # host, command...: run on that host, with its softrnic NIC
  local h="$1"
  shift
  # exec: started in the background, $! is the command itself (not a
  # subshell that a kill would leave the command behind).
  exec ip netns exec "${tag}$h" env LD_LIBRARY_PATH="$LIBDIR" \
    FERRY_SOFTRNIC_DEVICES="softrnic0=${IP[$h]}" "$@"
}

setup || abort "cannot create namespaces"

# The metadata server with its defaults: every interface, port 12050.
(on m "$MDS") >"$tmp/mds.log" 2>&1 &
pids+=($!)
wait_for "$tmp/mds.log" "listening on" ||
  abort "the metadata server did not start" "$tmp/mds.log"
MD="${IP[m]}:12050"

# Starts a target on host T; $1: a name for the logs, then its flags.
target_pid=""
start_target() {
  local name="$1"
  shift
  (on t "$BENCH" --mode=target --metadata_server="$MD" \
    --buffer_size=$((64 << 20)) --target_seconds=100 "$@") \
    >"$tmp/$name.target" 2>&1 &
  target_pid=$!
  pids+=("$target_pid")
  wait_for "$tmp/$name.target" "target ready"
}
stop_target() {
  kill "$target_pid" 2>/dev/null
  # Bounded: a target stuck in shutdown is killed after 10 s.
  local i gone=0
  for i in $(seq 100); do
    kill -0 "$target_pid" 2>/dev/null || { gone=1; break; }
    sleep 0.1
  done
  ((gone)) || kill -9 "$target_pid" 2>/dev/null
  wait "$target_pid" 2>/dev/null
  # Its ports must be free for the next target (bounded).
  local _
  for _ in $(seq 50); do
    ip netns exec "${tag}t" ss -ltn | grep -q ":12345 " || return 0
    sleep 0.1
  done
}

# $1: name; $2: the target's segment name; then initiator flags.
run_initiator() {
  local name="$1" segment="$2"
  shift 2
  (on i timeout 60 "$BENCH" --mode=initiator --metadata_server="$MD" \
    --segment_id="$segment" --verify --buffer_size=$((64 << 20)) \
    --threads=1 --batch_size=16 --duration=1 --report=json "$@") >"$tmp/$name.json" 2>"$tmp/$name.err"
}

for proto in tcp rdma; do
  # Mooncake's flags: the segment name is host:port and says both.
  seg="${IP[t]}:12345"
  if start_target "mc_$proto" --protocol="$proto" --local_server_name="$seg"; then
    if grep -q "advertised=${IP[t]} " "$tmp/mc_$proto.target"; then
      pass "$proto: --local_server_name=$seg advertises ${IP[t]}"
    else
      fail "$proto: advertised address" "$tmp/mc_$proto.target"
    fi
    for op in write read; do
      if run_initiator "mc_${proto}_$op" "$seg" --protocol="$proto" \
          --local_server_name="${IP[i]}:12346" --operation="$op" &&
          grep -q '"errors":0' "$tmp/mc_${proto}_$op.json"; then
        pass "$proto $op, Mooncake flags: $(tail -1 "$tmp/mc_${proto}_$op.json" | cut -c1-120)"
      else
        fail "$proto $op, Mooncake flags" \
          "$tmp/mc_${proto}_$op.err" "$tmp/mc_${proto}_$op.json"
      fi
    done
  else
    fail "$proto: target did not start" "$tmp/mc_$proto.target"
  fi
  stop_target

  # No address flags at all: the engine finds its routable address.
  if start_target "auto_$proto" --protocol="$proto" --segment_id=auto; then
    if grep -q "advertised=${IP[t]} " "$tmp/auto_$proto.target"; then
      pass "$proto: no address flag advertises ${IP[t]} ($(grep -o '(.*)' "$tmp/auto_$proto.target" | head -1))"
    else
      fail "$proto: advertised address with no flags" "$tmp/auto_$proto.target"
    fi
    if run_initiator "auto_$proto" auto --protocol="$proto" --operation=write &&
        grep -q '"errors":0' "$tmp/auto_$proto.json"; then
      pass "$proto write, no address flags"
    else
      fail "$proto write, no address flags" \
        "$tmp/auto_$proto.err" "$tmp/auto_$proto.json"
    fi
  else
    fail "$proto: target did not start" "$tmp/auto_$proto.target"
  fi
  stop_target
done

# A target that advertises loopback to a peer on another host: the
# initiator refuses at once, saying so (it used to retry millions of
# times against its own loopback).
if start_target "loop" --protocol=tcp --segment_id=loop --advertise_host=127.0.0.1; then
  if grep -q "advertises the loopback address 127.0.0.1 to the metadata service" "$tmp/loop.target"; then
    pass "the target warns that it advertises loopback to a remote metadata service"
  else
    fail "no warning from the loopback target" "$tmp/loop.target"
  fi
  start=$(date +%s%N)
  if run_initiator "loop" loop --protocol=tcp --operation=write; then
    fail "loopback target: the initiator succeeded"
  elif grep -q "loopback address 127.0.0.1" "$tmp/loop.err" &&
      (( ($(date +%s%N) - start) / 1000000 < 10000 )); then
    pass "loopback target refused: $(grep -o "segment 'loop' advertises[^,]*" "$tmp/loop.err" | head -1)"
  else
    fail "loopback target: no clear error" "$tmp/loop.err"
  fi
else
  fail "loopback target did not start" "$tmp/loop.target"
fi
stop_target

finish
