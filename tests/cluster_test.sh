#!/bin/bash
# tools/cluster end to end: a 3-host cluster with two NICs per host moves
# verified bytes over TCP and RDMA (softrnic) from two initiators to one
# target; shaping caps the rate; and whatever way the cluster ends --
# its command finishing, Ctrl-C, or kill -9 of the cluster followed by
# `tools/cluster clean` -- no namespace or process of it is left.
# Needs root (ip netns). Prints "N passed, N failed".
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
CLUSTER="$RUNFILES/tools/cluster"
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  abort "cluster_test needs root and iproute2 (ip netns)"
fi
cleanup() {
  # Only what a failed case may have left: the clusters' own tear-down is
  # what is under test.
  local p
  for p in $(jobs -p); do kill -9 "$p" 2>/dev/null; done
  "$CLUSTER" clean 2>/dev/null
}
at_exit cleanup

# The namespaces and processes of the cluster whose state is in $1, as
# the command inside recorded them (left.ns, left.pids). Prints what is
# still there; empty if nothing.
leftovers() {
  local ns p
  for ns in $(cat "$1/left.ns" 2>/dev/null); do
    ip netns list | awk '{print $1}' | grep -qx "$ns" && echo "namespace $ns"
  done
  # A zombie is a dead process its parent has yet to reap: gone. (One the
  # killed cluster left goes to init, which here may never reap it.)
  for p in $(cat "$1/left.pids" 2>/dev/null); do
    [[ -e /proc/$p && $(cut -d' ' -f3 "/proc/$p/stat" 2>/dev/null) != Z ]] &&
      echo "process $p ($(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-80))"
  done
}
# Run inside a cluster (as its command or from outside with CLUSTER_ENV
# set): records its namespaces and the processes in them.
record='source "$CLUSTER_ENV"
  for ((i = 1; i <= CLUSTER_HOSTS; i++)); do
    echo "${CLUSTER_TAG}h$i"; ip netns pids "${CLUSTER_TAG}h$i" >>"$STATE/left.pids"
  done >"$STATE/left.ns"; echo "${CLUSTER_TAG}sw" >>"$STATE/left.ns"'

# 1. Transfers across hosts, both transports: two initiators READ the
# target at once (checked against the pattern its buffer was filled with,
# which nothing has written over), then one WRITEs (read back, compared).
s1="$tmp/s1"
mkdir -p "$s1"
STATE="$s1" timeout 240 "$CLUSTER" --bin "$RUNFILES" --hosts 3 --nics 2 \
  --buffer_size=$((64 << 20)) --state "$s1" -- bash -c "$record"'
  run() {  # initiator host, protocol, operation, then flags
    local h=$1 proto=$2 op=$3 ip="CLUSTER_IP_$1_1"
    shift 3
    cluster_exec "$h" "$CLUSTER_BIN/tools/transfer_bench" --mode=initiator \
      --protocol="$proto" --operation="$op" --metadata_server="$CLUSTER_MD" \
      --segment_id="$CLUSTER_SEGMENT_3" --buffer_size=$((16 << 20)) \
      --local_server_name="${!ip}:12346" --threads=2 --batch_size=16 \
      --duration=1 --verify --report=json "$@" \
      >"$STATE/$proto.$op.$h.json" 2>"$STATE/$proto.$op.$h.err"
  }
  for proto in tcp rdma; do
    run 1 "$proto" read --noverify_prepare &
    run 2 "$proto" read --noverify_prepare
    wait
  done
  for proto in tcp rdma; do run 1 "$proto" write; done' >"$tmp/s1.out" 2>&1
rc=$?
ok=1
for f in tcp.read.1 tcp.read.2 rdma.read.1 rdma.read.2 tcp.write.1 rdma.write.1; do
  grep -q '"errors":0' "$s1/$f.json" 2>/dev/null &&
    grep -q '"verified":true' "$s1/$f.json" || ok=0
done
# Both rails of the RDMA runs carried traffic.
grep -q '"name":"softrnic1","port_active":true,"slices":[1-9]' "$s1/rdma.write.1.json" || ok=0
if ((rc == 0 && ok)); then
  pass "3 hosts x 2 NICs: hosts 1 and 2 read host 3 at once, host 1 wrote it, every byte verified, over tcp and rdma, both rails used"
else
  fail "transfers in the cluster (rc $rc)" "$tmp/s1.out" "$s1"/*.json "$s1"/*.err
fi
left="$(leftovers "$s1")"
if [[ -s $s1/left.ns && -s $s1/left.pids && -z $left ]]; then
  pass "after the command: no namespace or process left ($(wc -l <"$s1/left.pids") processes were running)"
else
  fail "left after the command: ${left:-nothing recorded}"
fi

# 2. Shaping: 200 Mbit/s links cap a TCP run well below loopback speed.
s2="$tmp/s2"
mkdir -p "$s2"
STATE="$s2" timeout 120 "$CLUSTER" --bin "$RUNFILES" --hosts 2 --rate 200mbit \
  --buffer_size=$((64 << 20)) --state "$s2" -- bash -c 'source "$CLUSTER_ENV"
  cluster_exec 1 "$CLUSTER_BIN/tools/transfer_bench" --mode=initiator \
    --protocol=tcp --metadata_server="$CLUSTER_MD" \
    --segment_id="$CLUSTER_SEGMENT_2" --buffer_size=$((16 << 20)) \
    --threads=1 --batch_size=16 --duration=2 --report=json' \
  >"$s2/run.json" 2>"$s2/run.err"
gbps="$(sed -n 's/.*"throughput_gbps":\([0-9.]*\).*/\1/p' "$s2/run.json" | tail -1)"
# 200 Mbit/s is 0.025 GB/s; allow the bucket's burst.
if [[ -n $gbps ]] && python3 -c "import sys; sys.exit(0 if 0 < $gbps < 0.04 else 1)"; then
  pass "--rate 200mbit: TCP moved $gbps GB/s (link: 0.025)"
else
  fail "--rate 200mbit: ${gbps:-no rate}" "$s2/run.json" "$s2/run.err"
fi

# 3. Ctrl-C tears the cluster down.
s3="$tmp/s3"
mkdir -p "$s3"
timeout 120 "$CLUSTER" --bin "$RUNFILES" --hosts 2 --state "$s3" >"$s3/out" 2>&1 &
cpid=$!
# Up to 60 s, while the cluster runs (tools/cluster's own bounds add up
# to more than 15 s on a slow machine).
for _ in $(seq 1200); do
  [[ -s $s3/cluster.env ]] || ! kill -0 "$cpid" 2>/dev/null && break
  sleep 0.05
done
CLUSTER_ENV="$s3/cluster.env" STATE="$s3" bash -c "$record"
kill -INT "$cpid"
wait "$cpid"
rc=$?
left="$(leftovers "$s3")"
if [[ -s $s3/left.pids && -z $left ]]; then
  pass "Ctrl-C: torn down (exit $rc), nothing left"
else
  fail "left after Ctrl-C: ${left:-nothing recorded}" "$s3/out"
fi

# 4. kill -9 of the cluster leaves it all; `tools/cluster clean` removes it.
s4="$tmp/s4"
mkdir -p "$s4"
"$CLUSTER" --bin "$RUNFILES" --hosts 2 --state "$s4" >"$s4/out" 2>&1 &
cpid=$!
for _ in $(seq 1200); do  # As for s3.
  [[ -s $s4/cluster.env ]] || ! kill -0 "$cpid" 2>/dev/null && break
  sleep 0.05
done
CLUSTER_ENV="$s4/cluster.env" STATE="$s4" bash -c "$record"
kill -9 "$cpid"
wait "$cpid" 2>/dev/null
before="$(leftovers "$s4")"
"$CLUSTER" clean
after="$(leftovers "$s4")"
if [[ -n $before && -z $after ]]; then
  pass "kill -9 left $(wc -l <<<"$before") namespaces and processes; clean removed them all"
else
  fail "kill -9 then clean: before [$before] after [$after]" "$s4/out"
fi

# 5. Bad arguments get a clear error, and no cluster.
out="$("$CLUSTER" --bin "$RUNFILES" --hosts 1 2>&1)"
rc=$?
if ((rc == 2)) && grep -q "hosts must be 2..64" <<<"$out"; then
  pass "--hosts 1 refused: $out"
else
  fail "--hosts 1 (exit $rc): $out"
fi
# A flag without its value: an error, not a hang.
out="$(timeout 10 "$CLUSTER" --bin "$RUNFILES" --hosts 2>&1)"
rc=$?
if ((rc == 2)) && grep -q "needs a value" <<<"$out"; then
  pass "--hosts without a value refused: $out"
else
  fail "--hosts without a value (exit $rc): $out"
fi
# --delay needs netem: either it works or the error says so.
out="$(timeout 60 "$CLUSTER" --bin "$RUNFILES" --hosts 2 --delay 1ms -- true 2>&1)"
rc=$?
if ((rc == 0)) || { ((rc == 2)) && grep -q "netem" <<<"$out"; }; then
  pass "--delay 1ms: exit $rc${out:+ ($(tail -1 <<<"$out"))}"
else
  fail "--delay 1ms (exit $rc): $out"
fi

finish
