#!/bin/bash
# Engines on an etcd v3 cluster (Debian's etcd-server, one member on
# loopback), with the real processes:
#   1. a target and an initiator with --metadata_server=etcd://...,
#      over TCP and over RDMA (softrnic), verified data;
#   2. two metadata_servers on one etcd (--etcd): a target published
#      through one is reached by an initiator that asks the other;
#   3. namespaces: a segment of cluster A is invisible from cluster B;
#   4. a target killed with SIGKILL: etcd's lease removes its segment;
#   5. metadata_server's --etcd_* limits reach its etcd store.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
BENCH="$RUNFILES/tools/transfer_bench"
MDS="$RUNFILES/tools/metadata_server"
LIBDIR="$RUNFILES/transport/softrnic"
if [[ ! -x /usr/bin/etcd ]]; then
  echo "FAIL: etcd not installed (apt-get install etcd-server; tools/dev.sh setup)"
  echo "0 passed, 1 failed"
  exit 1
fi

cport=$(free_port)
pport=$(free_port)
/usr/bin/etcd --name=m0 --data-dir="$tmp/etcd" \
  --listen-client-urls="http://127.0.0.1:$cport" \
  --advertise-client-urls="http://127.0.0.1:$cport" \
  --listen-peer-urls="http://127.0.0.1:$pport" \
  --initial-advertise-peer-urls="http://127.0.0.1:$pport" \
  --initial-cluster="m0=http://127.0.0.1:$pport" \
  --heartbeat-interval=50 --election-timeout=500 \
  --logger=zap --log-level=error >"$tmp/etcd.log" 2>&1 &
pids+=($!)
# Up to 30 s for etcd to serve (a leader elected): it accepts connections
# before that, so its /health, not a connect, says it is ready.
etcd_healthy() {
  python3 -c "import json, sys, urllib.request as u; sys.exit(json.load(u.urlopen('http://127.0.0.1:$cport/health', timeout=2)).get('health') != 'true')" 2>/dev/null
}
deadline=$((SECONDS + 30))  # By the clock: a poll itself takes time.
healthy=no
until ((SECONDS >= deadline)); do
  etcd_healthy && { healthy=yes; break; }
  sleep 0.1
done
if [[ $healthy != yes ]]; then
  fail "etcd did not become healthy in 30 s" "$tmp/etcd.log"
  finish
  exit 1
fi
ETCD="etcd://127.0.0.1:$cport"

start_target() {  # segment, log, protocol, metadata, then flags
  local seg=$1 log=$2 proto=$3 md=$4
  shift 4
  env LD_LIBRARY_PATH="$LIBDIR" "$BENCH" --mode=target --protocol="$proto" \
    --metadata_server="$md" --segment_id="$seg" --local_server_name="$seg" \
    --listen_host=127.0.0.1 --buffer_size=$((8 << 20)) --target_seconds=60 \
    "$@" >"$tmp/$log" 2>&1 &
  target_pid=$!
  pids+=($target_pid)
  wait_for "$tmp/$log" "target ready"
}
initiator() {  # segment, log, protocol, metadata, then flags
  local seg=$1 log=$2 proto=$3 md=$4
  shift 4
  timeout 60 env LD_LIBRARY_PATH="$LIBDIR" "$BENCH" --mode=initiator \
    --protocol="$proto" --metadata_server="$md" --segment_id="$seg" \
    --listen_host=127.0.0.1 --buffer_size=$((8 << 20)) --block_size=65536 \
    --threads=1 --batch_size=16 --duration=0.3 --verify --report=json "$@" >"$tmp/$log" 2>&1
}

# 1. Engines on etcd directly.
for proto in tcp rdma; do
  if start_target "t-$proto" "t-$proto.log" "$proto" "$ETCD" &&
    initiator "t-$proto" "i-$proto.json" "$proto" "$ETCD"; then
    pass "$proto: target and initiator on $ETCD moved verified data"
  else
    fail "$proto over etcd" "$tmp/t-$proto.log" "$tmp/i-$proto.json"
  fi
done

# 2. Two metadata_servers sharing one etcd.
md_ports=()
for n in 1 2; do
  port=$(free_port)
  md_ports+=("$port")
  "$MDS" --listen="127.0.0.1:$port" --etcd="$ETCD" >"$tmp/md$n.log" 2>&1 &
  pids+=($!)
  wait_for "$tmp/md$n.log" "listening" || fail "metadata_server $n" "$tmp/md$n.log"
done
if start_target via-md1 via-md1.log tcp "127.0.0.1:${md_ports[0]}" &&
  initiator via-md1 via-md2.json tcp "127.0.0.1:${md_ports[1]}"; then
  pass "a target published through one metadata_server was reached through another on the same etcd"
else
  fail "two metadata_servers on one etcd" "$tmp/via-md1.log" "$tmp/via-md2.json"
fi

# 3. Namespaces.
start_target shared ns-a.log tcp "$ETCD" --metadata_namespace=cluster-a
initiator shared ns-b.json tcp "$ETCD" --metadata_namespace=cluster-b
rc_b=$?
initiator shared ns-a.json tcp "$ETCD" --metadata_namespace=cluster-a
rc_a=$?
if ((rc_b != 0 && rc_a == 0)) && grep -q "not registered" "$tmp/ns-b.json"; then
  pass "a segment of namespace cluster-a is reached from cluster-a and not seen from cluster-b"
else
  fail "namespaces (from b: exit $rc_b, from a: exit $rc_a)" "$tmp/ns-b.json" "$tmp/ns-a.json"
fi

# 4. A killed target's segment goes with its etcd lease.
start_target doomed doomed.log tcp "$ETCD" --metadata_lease_seconds=1
kill -9 "$target_pid"
gone=no
for _ in $(seq 40); do
  initiator doomed after.json tcp "$ETCD" && continue
  grep -q "not registered" "$tmp/after.json" && { gone=yes; break; }
  sleep 0.25
done
if [[ $gone == yes ]]; then
  pass "a killed target's segment left etcd with its lease"
else
  fail "lease expiry on etcd" "$tmp/after.json" "$tmp/doomed.log"
fi

# 5. metadata_server's limits reach the etcd store: a quota of 64 bytes
# per client refuses any descriptor, naming itself.
port=$(free_port)
"$MDS" --listen="127.0.0.1:$port" --etcd="$ETCD" --etcd_max_client_bytes=64 \
  >"$tmp/md3.log" 2>&1 &
pids+=($!)
wait_for "$tmp/md3.log" "listening" || fail "metadata_server 3" "$tmp/md3.log"
timeout 30 env LD_LIBRARY_PATH="$LIBDIR" "$BENCH" --mode=target --protocol=tcp \
  --metadata_server="127.0.0.1:$port" --segment_id=capped \
  --local_server_name=capped --listen_host=127.0.0.1 \
  --buffer_size=$((1 << 20)) --target_seconds=5 >"$tmp/capped.log" 2>&1
if grep -q "would pass its quota of 64" "$tmp/capped.log"; then
  pass "metadata_server --etcd_max_client_bytes bounds what a client puts in etcd"
else
  fail "--etcd_max_client_bytes did not reach the etcd store" "$tmp/capped.log" "$tmp/md3.log"
fi

# 6. --etcd_timeout: an out-of-range one is refused, naming the flag; a
# longer one serves as the default does.
if ! timeout 10 "$MDS" --listen=127.0.0.1:0 --etcd="$ETCD" --etcd_timeout=1ms \
    >"$tmp/md4.log" 2>&1 && grep -q "etcd_timeout must be 100ms..5m" "$tmp/md4.log"; then
  pass "metadata_server refuses --etcd_timeout=1ms, naming the flag"
else
  fail "--etcd_timeout=1ms was not refused" "$tmp/md4.log"
fi
port=$(free_port)
"$MDS" --listen="127.0.0.1:$port" --etcd="$ETCD" --etcd_timeout=30s \
  >"$tmp/md5.log" 2>&1 &
pids+=($!)
wait_for "$tmp/md5.log" "listening" || fail "metadata_server 5" "$tmp/md5.log"
if timeout 30 env LD_LIBRARY_PATH="$LIBDIR" "$BENCH" --mode=target --protocol=tcp \
    --metadata_server="127.0.0.1:$port" --segment_id=patient \
    --local_server_name=patient --listen_host=127.0.0.1 \
    --buffer_size=$((1 << 20)) --target_seconds=1 >"$tmp/patient.log" 2>&1 &&
    grep -q "target ready" "$tmp/patient.log"; then
  pass "metadata_server --etcd_timeout=30s serves"
else
  fail "metadata_server --etcd_timeout=30s" "$tmp/patient.log" "$tmp/md5.log"
fi

finish
