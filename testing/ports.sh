# TCP port helpers shared by the benchmark scripts and the shell tests
# (sourced, not run):
#   free_port             a port that nothing is bound to now, outside the
#                         kernel's ephemeral range;
#   listening PORT        whether a TCP socket listens on PORT;
#   wait_listening PORT [PID [SECONDS]]   up to SECONDS (20) for a listener
#                         on PORT, less if process PID ends first; the
#                         status says whether one came.

# A port from the kernel's ephemeral range (ip_local_port_range) can be
# handed to any socket's bind(0) or connect() between this check and the
# server's own bind: perftest's server, for one, opens its device (whose
# softrnic listener binds port 0) before it binds the port it was given.
# Ports outside that range are taken only by an explicit bind. A wildcard
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
    low, high = (int(x) for x in
                 open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
except (OSError, ValueError):
    low, high = 32768, 60999
# Below the range if it leaves room there, else above it (a range that
# starts low, as some containers set it, usually ends below 65535). Not
# below 20000: the tests' and tools' fixed ports (12050, 12345, 17001,
# 18800, ...) are there.
span = (20000, low) if low > 21000 else (max(high + 1, 20000), 65536)
if span[1] - span[0] >= 1000:
    for _ in range(200):
        p = random.randrange(*span)
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
  printf -v hex '%04X' "$1"
  _listening_hex "$hex"
}
_listening_hex() {  # port in 4 hex digits
  local tables=(/proc/net/tcp)
  [[ -r /proc/net/tcp6 ]] && tables+=(/proc/net/tcp6)  # Absent without IPv6.
  awk -v p=":$1" 'FNR > 1 && $4 == "0A" && substr($2, length($2) - 4) == p \
    { found = 1 } END { exit !found }' "${tables[@]}"
}

# A fixed sleep is not enough: on a loaded CI machine (or under ASan) a
# perftest server opened its device and listened only after the client had
# given up. A server that has exited will never listen, so stop then.
wait_listening() {  # port [pid [seconds, 20 by default]]
  local hex polls=0 max=$((${3:-20} * 10))
  printf -v hex '%04X' "$1"
  while ! _listening_hex "$hex" && ((polls < max)); do
    if [[ -n "${2:-}" ]] && ! kill -0 "$2" 2>/dev/null; then break; fi
    sleep 0.1
    polls=$((polls + 1))
  done
  _listening_hex "$hex"
}
