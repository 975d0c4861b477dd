# Two hosts with two NICs each on one machine, for tests and benchmarks
# (sourced, not run): network namespaces $H1 and $H2 joined by two veth
# pairs on two subnets (rail 0: $A1 <-> $B1, rail 1: $A2 <-> $B2).
# Needs root and iproute2.
#   netns_begin TAG                  # $tmp, $pids; everything removed on exit
#   netns_setup                      # namespaces, links, addresses
#   netns_shape RATE                 # tc tbf on every link, both ways
#   in_h1 CMD... / in_h2 CMD...      # run in a host with its softrnic NICs
#   netns_link_down 1 2              # host 1, rail 2 (1-based) goes down

# TAG: a short prefix unique to this run (e.g. "t$$") for the names of
# namespaces and links. Makes the scratch directory $tmp and the list $pids
# (background processes to kill); on exit both go with the hosts.
netns_begin() {
  tag="$1"
  tmp="$(mktemp -d)"
  pids=()
  trap 'netns_cleanup; rm -rf "$tmp"' EXIT
}

netns_setup() {
  local n=$(($$ % 200 + 20))
  H1="${tag}h1"
  H2="${tag}h2"
  A1="10.77.$n.1" B1="10.77.$n.2"
  A2="10.78.$n.1" B2="10.78.$n.2"
  ip netns add "$H1" || return 1
  ip netns add "$H2" || return 1
  local i
  for i in 1 2; do
    ip link add "${tag}a$i" netns "$H1" type veth peer name "${tag}b$i" \
      netns "$H2" || return 1
  done
  ip -n "$H1" addr add "$A1/24" dev "${tag}a1"
  ip -n "$H1" addr add "$A2/24" dev "${tag}a2"
  ip -n "$H2" addr add "$B1/24" dev "${tag}b1"
  ip -n "$H2" addr add "$B2/24" dev "${tag}b2"
  for ns in "$H1" "$H2"; do ip -n "$ns" link set lo up; done
  for i in 1 2; do
    ip -n "$H1" link set "${tag}a$i" up
    ip -n "$H2" link set "${tag}b$i" up
  done
  # A veth reports carrier a moment after both ends are up; soft NICs
  # follow carrier, so wait for it (bounded).
  local tries
  for tries in $(seq 50); do
    if [[ $(ip -n "$H1" link show | grep -c "${tag}a.*LOWER_UP") == 2 &&
          $(ip -n "$H2" link show | grep -c "${tag}b.*LOWER_UP") == 2 ]]; then
      return 0
    fi
    sleep 0.1
  done
  echo "netns_setup: links have no carrier" >&2
  return 1
}

netns_shape() {
  local rate="$1" i
  for i in 1 2; do
    ip netns exec "$H1" tc qdisc add dev "${tag}a$i" root tbf rate "$rate" \
      burst 256kb latency 50ms
    ip netns exec "$H2" tc qdisc add dev "${tag}b$i" root tbf rate "$rate" \
      burst 256kb latency 50ms
  done
}

# Devices default to both rails; callers may set H1_DEVICES / H2_DEVICES.
in_h1() {
  ip netns exec "$H1" env LD_LIBRARY_PATH="$LIBDIR" \
    FERRY_SOFTRNIC_DEVICES="${H1_DEVICES:-softrnic0=$A1,softrnic1=$A2}" "$@"
}
in_h2() {
  ip netns exec "$H2" env LD_LIBRARY_PATH="$LIBDIR" \
    FERRY_SOFTRNIC_DEVICES="${H2_DEVICES:-softrnic0=$B1,softrnic1=$B2}" "$@"
}

netns_link_down() {  # host (1|2), rail (1|2)
  if [[ $1 == 1 ]]; then
    ip -n "$H1" link set "${tag}a$2" down
  else
    ip -n "$H2" link set "${tag}b$2" down
  fi
}

netns_cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  ip netns del "$H1" 2>/dev/null
  ip netns del "$H2" 2>/dev/null
  return 0
}
