#!/bin/bash
# Runs Debian's unmodified ibverbs-utils programs (ibv_devices, ibv_devinfo,
# ibv_rc_pingpong) on softrnic: they are linked against rdma-core's
# libibverbs and load softrnic's libibverbs.so.1 through LD_LIBRARY_PATH,
# exactly as an application would.
set -u
# shellcheck source=../../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"

LIBDIR="$RUNFILES/transport/softrnic"
[[ -e "$LIBDIR/libibverbs.so.1" ]] || abort "no libibverbs.so.1 in $LIBDIR"
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Debian's programs under --config=asan: the ASan runtime first.
source "$LIBDIR/asan_env.sh"
softrnic_asan_env "$LIBDIR"
((${#asan_env[@]} == 0)) || export "${asan_env[@]}"
export FERRY_SOFTRNIC_DEVICES="${FERRY_SOFTRNIC_DEVICES:-softrnic0=127.0.0.1,softrnic1=127.0.0.2}"
# A missing symbol then fails at load time with a clear message instead of
# in the middle of a run.
export LD_BIND_NOW=1

for prog in ibv_devices ibv_devinfo ibv_rc_pingpong; do
  command -v "$prog" >/dev/null ||
    abort "$prog not installed (apt-get install ibverbs-utils)"
done

OUT="$tmp"

# --- ibv_devices lists both devices (and, through it, that the library
# loads and is softrnic: rdma-core's would list nothing here).
if timeout 60 ibv_devices >"$OUT/devices.txt" 2>&1 &&
  grep -qw softrnic0 "$OUT/devices.txt" &&
  grep -qw softrnic1 "$OUT/devices.txt"; then
  pass "ibv_devices lists softrnic0 and softrnic1"
else
  fail "ibv_devices" "$OUT/devices.txt"
fi

# --- ibv_devinfo -v: exit 0, softrnic0 with an active Ethernet port and
# its IPv4-mapped GID (::ffff:127.0.0.1, printed by inet_ntop, e.g.
# "::a311:ffff:7f00:1" with a listener port in bytes 8..9).
if timeout 60 ibv_devinfo -v >"$OUT/devinfo.txt" 2>&1 &&
  grep -q "hca_id:.*softrnic0" "$OUT/devinfo.txt" &&
  grep -q "PORT_ACTIVE" "$OUT/devinfo.txt" &&
  grep -q "link_layer:.*Ethernet" "$OUT/devinfo.txt" &&
  grep -Eqi "ffff:7f00:0{0,3}1([^0-9a-f]|$)" "$OUT/devinfo.txt"; then
  pass "ibv_devinfo -v"
else
  fail "ibv_devinfo -v (exit 0, softrnic0, PORT_ACTIVE, Ethernet, GID)" \
    "$OUT/devinfo.txt"
fi

if timeout 60 ibv_devinfo -d softrnic1 >"$OUT/devinfo1.txt" 2>&1 &&
  grep -q "hca_id:.*softrnic1" "$OUT/devinfo1.txt" &&
  ! grep -q "hca_id:.*softrnic0" "$OUT/devinfo1.txt"; then
  pass "ibv_devinfo -d softrnic1"
else
  fail "ibv_devinfo -d softrnic1" "$OUT/devinfo1.txt"
fi

# Runs one ibv_rc_pingpong server/client pair: pingpong NAME SERVER_DEV
# CLIENT_DEV EXTRA_ARGS...
pingpong() {
  local name=$1 sdev=$2 cdev=$3
  shift 3
  local port
  port=$(free_port)
  timeout 60 ibv_rc_pingpong -d "$sdev" -g 0 -p "$port" "$@" \
    >"$OUT/$name.server.txt" 2>&1 &
  local spid=$!
  wait_listening "$port" "$spid" 30
  timeout 60 ibv_rc_pingpong -d "$cdev" -g 0 -p "$port" "$@" 127.0.0.1 \
    >"$OUT/$name.client.txt" 2>&1
  local crc=$?
  wait "$spid"
  local src=$?
  if [[ $crc -eq 0 && $src -eq 0 ]] &&
    grep -q "iters in" "$OUT/$name.client.txt" &&
    grep -q "iters in" "$OUT/$name.server.txt"; then
    pass "ibv_rc_pingpong $name ($(grep 'iters in' "$OUT/$name.client.txt"))"
  else
    fail "ibv_rc_pingpong $name (server exit $src, client exit $crc)" \
      "$OUT/$name.server.txt" "$OUT/$name.client.txt"
  fi
}

pingpong default softrnic0 softrnic0
# Completion channels (ibv_req_notify_cq / ibv_get_cq_event) instead of
# busy polling.
pingpong events softrnic0 softrnic0 -e
# Bigger messages than one MTU, more iterations.
pingpong large softrnic0 softrnic0 -s 65536 -n 200
# Server and client on different emulated NICs.
pingpong cross softrnic1 softrnic0

finish
