# Hosts on one machine, each a network namespace, for tools/cluster, the
# tests and the benchmarks (sourced, not run): the one place that makes
# namespaces, veth links, bridges and addresses, and removes them. Needs
# root and iproute2.
#
# Building blocks. Every namespace netns_add makes is removed by
# netns_remove_all, with every process still in it.
#   netns_add NS                     a namespace with its loopback up
#   netns_bridge NS BR               a bridge BR (a switch) in NS, up
#   netns_link NS1 IF1 NS2 IF2       a veth pair: IF1 in NS1, IF2 in NS2
#   netns_port NS IF SW BR PORT      NS's IF cabled to bridge BR of SW
#                                    (SW's end: PORT, up)
#   netns_addr NS IF ADDR/LEN        an address on IF, and IF up
#   netns_wait_carrier NS IFS N      until N links of NS whose names match
#                                    the ERE IFS have carrier (at most 5 s)
#   netns_remove NS                  every process in NS killed, then NS
#   netns_remove_all                 every namespace netns_add made
#
# Two hosts with two NICs each (the tests' and benchmarks' topology):
# namespaces $H1 and $H2 joined by two veth pairs on two subnets (rail 0:
# $A1 <-> $B1, rail 1: $A2 <-> $B2).
#   netns_begin TAG                  # $tmp, $pids; everything removed on exit
#   netns_setup                      # namespaces, links, addresses
#   netns_shape RATE                 # tc tbf on every link, both ways
#   in_h1 CMD... / in_h2 CMD...      # run in a host with its softrnic NICs
#   netns_link_down 1 2              # host 1, rail 2 (1-based) goes down

netns_names=()

netns_add() {  # namespace
  ip netns add "$1" || return 1
  netns_names+=("$1")
  ip -n "$1" link set lo up
}

netns_bridge() {  # namespace, bridge
  ip -n "$1" link add "$2" type bridge && ip -n "$1" link set "$2" up
}

netns_link() {  # namespace 1, interface 1, namespace 2, interface 2
  ip link add "$2" netns "$1" type veth peer name "$4" netns "$3"
}

netns_port() {  # namespace, interface, switch namespace, bridge, port
  netns_link "$1" "$2" "$3" "$5" || return 1
  ip -n "$3" link set "$5" master "$4"
  ip -n "$3" link set "$5" up
}

netns_addr() {  # namespace, interface, address/prefix length
  ip -n "$1" addr add "$3" dev "$2"
  ip -n "$1" link set "$2" up
}

# A veth reports carrier a moment after both ends are up; soft NICs
# follow carrier, so whoever binds one to a link waits for it (bounded).
netns_wait_carrier() {  # namespace, interface names (ERE), how many
  local _ up=0
  for _ in $(seq 100); do
    up=$(ip -n "$1" link show | grep -cE "^[0-9]+: ($2)@.*LOWER_UP")
    ((up == $3)) && return 0
    sleep 0.05
  done
  echo "netns: only $up of $3 links in $1 have carrier" >&2
  return 1
}

# Kills every process in the namespace (they would outlive it), then
# removes it, and with it its interfaces.
netns_remove() {  # namespace
  local p _
  for _ in 1 2 3 4 5; do
    p="$(ip netns pids "$1" 2>/dev/null)"
    [[ -z "$p" ]] && break
    # shellcheck disable=SC2086  # One pid a word.
    kill -9 $p 2>/dev/null
    sleep 0.1
  done
  ip netns del "$1" 2>/dev/null
}

netns_remove_all() {
  local i
  for ((i = ${#netns_names[@]} - 1; i >= 0; i--)); do
    netns_remove "${netns_names[$i]}"
  done
  netns_names=()
  return 0
}

# TAG: a short prefix unique to this run (e.g. "t$$") for the names of
# namespaces and links. Makes the scratch directory $tmp and the list $pids
# (background processes to kill); on exit both go with the hosts. In a test
# (testing/test_lib.sh sourced first) the test's $tmp and $pids serve, and
# the hosts go at its exit.
netns_begin() {
  tag="$1"
  if declare -F at_exit >/dev/null; then
    at_exit netns_cleanup
    return
  fi
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
  netns_add "$H1" || return 1
  netns_add "$H2" || return 1
  local i
  for i in 1 2; do
    netns_link "$H1" "${tag}a$i" "$H2" "${tag}b$i" || return 1
  done
  netns_addr "$H1" "${tag}a1" "$A1/24"
  netns_addr "$H1" "${tag}a2" "$A2/24"
  netns_addr "$H2" "${tag}b1" "$B1/24"
  netns_addr "$H2" "${tag}b2" "$B2/24"
  netns_wait_carrier "$H1" "${tag}a[12]" 2 &&
    netns_wait_carrier "$H2" "${tag}b[12]" 2
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

# The processes in $pids, then the namespaces with whatever still runs in
# them (a command started in a host from a function: $! is the subshell),
# then a wait for the rest.
netns_cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  ((${#pids[@]} == 0)) || wait "${pids[@]}" 2>/dev/null || true
  netns_remove_all
  wait 2>/dev/null
}
