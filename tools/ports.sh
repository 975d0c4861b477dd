# TCP port helpers shared by the benchmark scripts and the shell tests
# (sourced, not run):
#   free_port             a port that nothing is bound to now, outside the
#                         kernel's ephemeral range;
#   listening PORT        whether a TCP socket listens on PORT;
#   wait_listening PORT [PID]   up to 20 s for a listener on PORT (less if
#                         process PID ends first); the status says whether
#                         one came.

# A port from the kernel's ephemeral range (ip_local_port_range) can be
# handed to any socket's bind(0) or connect() between this check and the
# server's own bind: perftest's server, for one, opens its device (whose
# softrnic listener binds port 0) before it binds the port it was given.
# Ports below that range are taken only by an explicit bind. A wildcard
# bind without SO_REUSEADDR is refused if any address holds the port, even
# by a connection in TIME_WAIT, so a port that passes is free everywhere.
free_port() {
  python3 - <<'EOF'
import random, socket
def free(p):
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", p))
        return True
    except OSError:
        return False
    finally:
        s.close()
try:
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except (OSError, ValueError, IndexError):
    low = 0
for _ in range(200):
    if low <= 11000:
        break
    p = random.randrange(10000, low)
    if free(p):
        print(p)
        raise SystemExit
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
EOF
}

# From /proc, not by connecting: a one-shot server (perftest,
# ibv_rc_pingpong) would take a probing connection as its peer.
listening() {  # port
  local hex
  hex=$(printf '%04X' "$1")
  local tables=(/proc/net/tcp)
  [[ -r /proc/net/tcp6 ]] && tables+=(/proc/net/tcp6)  # Absent without IPv6.
  awk -v p=":$hex" 'FNR > 1 && $4 == "0A" && substr($2, length($2) - 4) == p \
    { found = 1 } END { exit !found }' "${tables[@]}"
}

# A fixed sleep is not enough: on a loaded CI machine (or under ASan) a
# perftest server opened its device and listened only after the client had
# given up. A server that has exited will never listen, so stop then.
wait_listening() {  # port [pid]
  local waited=0
  while ! listening "$1" && ((waited < 400)); do
    if [[ -n "${2:-}" ]] && ! kill -0 "$2" 2>/dev/null; then break; fi
    sleep 0.05
    waited=$((waited + 1))
  done
  listening "$1"
}
