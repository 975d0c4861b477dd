#!/bin/bash
# Leases and re-publication, with the real processes: a standalone
# tools/metadata_server and transfer_bench engines on loopback (TCP).
#   1. a target killed with SIGKILL: its segment is gone after its lease
#      (1 s here), and a new initiator's open fails with NotFound at once;
#      a second target cannot take a live target's name, and a run
#      restarted after a kill -9 takes it back once the lease has ended;
#   2. the metadata_server killed with SIGKILL and restarted empty on the
#      same port: a live target publishes its segment again by itself, and
#      a new initiator reaches it;
#   3. while the metadata_server is down, an initiator whose connection is
#      already up (to another target) keeps moving verified data;
#   4. a durable metadata_server (--data_dir) killed with SIGKILL and
#      restarted has every segment at once;
#   5. --auth_token_file: a call without the token is refused.
#   6. --tls_*: with mutual TLS (certificates made here with openssl), an
#      engine without a certificate from the cluster CA cannot join; one
#      with it moves verified data;
#   7. one with no token on 0.0.0.0 warns that it is open.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
BENCH="$RUNFILES/tools/transfer_bench"
MDS="$RUNFILES/tools/metadata_server"

port=$(free_port)
MD="127.0.0.1:$port"
start_md() {  # log name, then metadata_server flags
  local log=$1
  shift
  "$MDS" --listen="$MD" "$@" >"$tmp/$log" 2>&1 &
  md_pid=$!
  pids+=($md_pid)
  wait_for "$tmp/$log" "listening" "$md_pid" || sleep 1
}
start_target() {  # segment, log name, then flags
  local seg=$1 log=$2
  shift 2
  "$BENCH" --mode=target --protocol=tcp --metadata_server="$MD" \
    --segment_id="$seg" --local_server_name="$seg" --listen_host=127.0.0.1 \
    --buffer_size=$((8 << 20)) --metadata_lease_seconds=1 \
    --target_seconds=60 "$@" >"$tmp/$log" 2>&1 &
  target_pid=$!
  pids+=($target_pid)
  wait_for "$tmp/$log" "target ready" "$target_pid"
}
initiator() {  # segment, seconds, log name, then flags
  local seg=$1 secs=$2 log=$3
  shift 3
  timeout 60 "$BENCH" --mode=initiator --protocol=tcp --metadata_server="$MD" \
    --segment_id="$seg" --listen_host=127.0.0.1 --buffer_size=$((8 << 20)) \
    --block_size=65536 --threads=1 --batch_size=16 --duration="$secs" --verify --max_consecutive_errors=1000000 \
    --report=json "$@" >"$tmp/$log" 2>&1
}

start_md md1.log
# 1. Lease expiry after kill -9.
start_target doomed doomed.log || fail "target did not start" "$tmp/doomed.log"
initiator doomed 0.5 before.json
rc1=$?
kill -9 "$target_pid"
killed_at=$(date +%s%N)
# Until the lease (1 s) has run out and the service has dropped the
# segment: an open then fails with "not registered". Polled, not slept: a
# loaded machine may take longer, and an idle one should not wait more.
for _ in $(seq 60); do
  initiator doomed 0.2 after.json
  rc2=$?
  ((rc2 != 0)) && grep -q "not registered" "$tmp/after.json" && break
  sleep 0.2
done
gone_ms=$((($(date +%s%N) - killed_at) / 1000000))
if ((rc1 == 0 && rc2 != 0)) && grep -q "not registered" "$tmp/after.json"; then
  pass "a killed target's segment is gone ${gone_ms} ms after the kill (1 s lease): $(grep -o "segment 'doomed'[^\"]*" "$tmp/after.json" | head -1)"
else
  fail "lease expiry (before: exit $rc1, after: exit $rc2)" "$tmp/after.json" "$tmp/md1.log"
fi

# 1b. Ownership of the name: a second target under a live target's name
# fails (its lease is renewed), and a run restarted right after a kill -9
# takes the name back once the dead run's lease has ended.
start_target owned owned.log || fail "target did not start" "$tmp/owned.log"
owner_pid=$target_pid
timeout 30 "$BENCH" --mode=target --protocol=tcp --metadata_server="$MD" \
  --segment_id=owned --local_server_name=owned --listen_host=127.0.0.1 \
  --metadata_lease_seconds=1 --target_seconds=60 >"$tmp/dup.log" 2>&1
rc_dup=$?
kill -9 "$owner_pid"
start_target owned restarted.log
rc_restart=$?
if ((rc_dup != 0)) && grep -q "ALREADY_EXISTS.*held by a live engine" "$tmp/dup.log" &&
  ((rc_restart == 0)) && initiator owned 0.3 owned.json; then
  pass "a live segment's name is refused to a second engine; a restarted run takes it back after the lease"
else
  fail "name ownership (duplicate exit $rc_dup, restart $rc_restart)" "$tmp/dup.log" "$tmp/restarted.log" "$tmp/owned.json"
fi
kill "$target_pid" 2>/dev/null

# 2 and 3. The metadata_server dies and comes back empty. Two targets, so
# that the two initiators never write the same memory.
start_target live live.log || fail "target did not start" "$tmp/live.log"
live_pid=$target_pid
start_target steady steady.log || fail "target did not start" "$tmp/steady.log"
initiator steady 6 during.json &
during_pid=$!
# Its first progress line: it has opened the segment and moves data (a
# fixed sleep lost that race on a loaded machine).
wait_for "$tmp/during.json" '^\[ *[0-9.]*s,' "$during_pid" ||
  fail "the initiator made no progress before the outage" "$tmp/during.json"
kill -9 "$md_pid"
wait "$md_pid" 2>/dev/null
# Down until the live target has seen its renewals fail (a condition, not
# a fixed time that a loaded machine may not honour).
wait_for "$tmp/live.log" "lease of segment 'live' not renewed" "$live_pid" ||
  fail "the target logged no failed renewal while the service was down" "$tmp/live.log"
start_md md2.log
republished=no
wait_for "$tmp/live.log" "published again" "$live_pid" && republished=yes
initiator live 0.5 new.json
rc_new=$?
if [[ $republished == yes ]] && ((rc_new == 0)); then
  pass "after a metadata_server restart the target published its segment again; a new initiator reached it"
else
  fail "re-publication (published again: $republished, new initiator exit $rc_new)" "$tmp/live.log" "$tmp/new.json"
fi
wait "$during_pid"
rc_during=$?
if ((rc_during == 0)) && python3 - "$tmp/during.json" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
sys.exit(0 if r["errors"] == 0 and r["verified"] and r["bytes"] > 0 else 1)
PY
then
  pass "an initiator with its connection up moved verified data, with no error, while the metadata_server was down"
else
  fail "transfers during the outage (exit $rc_during)" "$tmp/during.json"
fi

# 4. A durable metadata_server (--data_dir) killed with SIGKILL and
# restarted keeps its segments: a new initiator reaches the target at once,
# and the target never had to publish again.
kill -9 "$md_pid"
wait "$md_pid" 2>/dev/null
start_md md3.log --data_dir="$tmp/mddata"
# A 10 s lease: the segment must outlive the restart's time down however
# slowly the restarted server comes up (the recovered lease runs from its
# recovery), so only a lost segment makes the target publish again.
start_target kept kept.log --metadata_lease_seconds=10 ||
  fail "target did not start" "$tmp/kept.log"
kill -9 "$md_pid"
wait "$md_pid" 2>/dev/null
start_md md4.log --data_dir="$tmp/mddata"
if grep -q "segments recovered" "$tmp/md4.log" && initiator kept 0.3 kept.json &&
  ! grep -q "published again" "$tmp/kept.log"; then
  pass "a durable metadata_server restarted after kill -9 kept the segments: $(grep -o '[0-9]* segments recovered' "$tmp/md4.log")"
else
  fail "durable restart" "$tmp/md4.log" "$tmp/kept.log" "$tmp/kept.json"
fi

# 5. Auth: a metadata_server and engines sharing a token; an initiator
# without it is refused UNAUTHENTICATED, one with it moves verified data.
kill -9 "$md_pid"
wait "$md_pid" 2>/dev/null
echo "ferry-test-token-5d1c0e8a" >"$tmp/token"
start_md md5.log --auth_token_file="$tmp/token"
start_target guarded guarded.log --auth_token_file="$tmp/token" ||
  fail "target with the token did not start" "$tmp/guarded.log"
initiator guarded 0.3 no-token.json
rc_none=$?
initiator guarded 0.3 token.json --auth_token_file="$tmp/token"
rc_token=$?
if ((rc_none != 0 && rc_token == 0)) && grep -q "UNAUTHENTICATED" "$tmp/no-token.json"; then
  pass "with --auth_token_file a call without the token is refused UNAUTHENTICATED; with it, verified data"
else
  fail "auth (without: exit $rc_none, with: exit $rc_token)" "$tmp/no-token.json" "$tmp/token.json" "$tmp/guarded.log"
fi

# 6. Mutual TLS on the metadata_server and the engines' peer services.
kill -9 "$md_pid"
wait "$md_pid" 2>/dev/null
(
  cd "$tmp" || exit 1
  # The URI names the segments the certificate may publish (any here).
  printf 'subjectAltName=IP:127.0.0.1,URI:ferry-segment:*\n' >san.cnf
  timeout 60 openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=ferry-test-ca &&
    timeout 60 openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
      -nodes -keyout node.key -out node.csr -subj /CN=node &&
    timeout 60 openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key \
      -CAcreateserial -out node.pem -days 2 -extfile san.cnf
) >"$tmp/openssl.log" 2>&1 || fail "openssl could not make certificates" "$tmp/openssl.log"
tls=(--tls_ca_file="$tmp/ca.pem" --tls_cert_file="$tmp/node.pem" --tls_key_file="$tmp/node.key")
start_md md6.log "${tls[@]}"
grep -q "mutual TLS" "$tmp/md6.log" || fail "metadata_server did not say TLS" "$tmp/md6.log"
start_target sealed sealed.log "${tls[@]}" ||
  fail "target with TLS did not start" "$tmp/sealed.log"
initiator sealed 0.3 no-tls.json
rc_plain=$?
initiator sealed 0.3 tls.json "${tls[@]}"
rc_tls=$?
if ((rc_plain != 0 && rc_tls == 0)) && grep -q "UNAVAILABLE" "$tmp/no-tls.json"; then
  pass "with --tls_* an engine without a certificate cannot join (exit $rc_plain); with one, verified data"
else
  fail "tls (without: exit $rc_plain, with: exit $rc_tls)" "$tmp/no-tls.json" "$tmp/tls.json" "$tmp/sealed.log" "$tmp/md6.log"
fi

# 7. A metadata_server with no token that listens beyond loopback says it
# is open (once); on loopback (md1) or with TLS (md6) it does not.
open_port=$(free_port)
"$MDS" --listen="0.0.0.0:$open_port" >"$tmp/md7.log" 2>&1 &
md7=$!
pids+=("$md7")
wait_for "$tmp/md7.log" "listening" "$md7" || true
if grep -q "metadata_server listens on .* with no auth token" "$tmp/md7.log" &&
  ! grep -q "no auth token" "$tmp/md1.log" "$tmp/md6.log"; then
  pass "an open metadata_server on 0.0.0.0 warns; on loopback or with TLS it does not"
else
  fail "open-server warning" "$tmp/md7.log" "$tmp/md1.log"
fi

finish
