#!/bin/bash
# Runs a two-process verbs example (its binary is the first argument; any
# further arguments go to both roles): the server in the background on a
# free port (--port 0; it prints the port), then the client. Fails unless
# both exit 0 within their time and print their line. With
# FERRY_SOFTRNIC_LIB (a runfiles-relative folder) both run on softrnic's
# libibverbs.so.1.
set -euo pipefail
bin="$1"
shift
if [[ -n "${FERRY_SOFTRNIC_LIB:-}" ]]; then
  export LD_LIBRARY_PATH="${TEST_SRCDIR}/${TEST_WORKSPACE}/${FERRY_SOFTRNIC_LIB}"
  export FERRY_SOFTRNIC_DEVICES="${FERRY_SOFTRNIC_DEVICES:-softrnic0=127.0.0.1}"
fi
dir="$(mktemp -d "${TEST_TMPDIR:-/tmp}/verbs_example.XXXXXX")"
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT

# The files exist before the server starts: the background job opens its
# redirections only once it runs, and the poll below must not read a file
# that is not there yet (sed fails, and set -e ends the script: seen in a
# cold CI run).
: >"$dir/server.out"
: >"$dir/server.err"
"$bin" --server --port 0 "$@" >"$dir/server.out" 2>"$dir/server.err" &
server_pid=$!
port=""
for _ in $(seq 100); do  # Up to 10 s for the server to listen.
  port="$(sed -n 's/^server: listening on port \([0-9][0-9]*\)$/\1/p' \
    "$dir/server.out")"
  [[ -n "$port" ]] && break
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.1
done

client_rc=0
if [[ -n "$port" ]]; then
  timeout 60 "$bin" --client 127.0.0.1 --port "$port" "$@" \
    >"$dir/client.out" 2>"$dir/client.err" || client_rc=$?
else
  client_rc=125  # Not run.
fi
server_rc=0
for _ in $(seq 300); do  # Up to 30 s more for the server to finish.
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$server_pid" 2>/dev/null; then
  server_rc=124  # Still running: the trap kills it.
else
  wait "$server_pid" || server_rc=$?
  server_pid=""
fi

for f in server.out server.err client.out client.err; do
  if [[ -s "$dir/$f" ]]; then sed "s/^/[$f] /" "$dir/$f"; fi
done
ok=1
[[ -n "$port" ]] || { echo "FAIL: the server never printed its port"; ok=0; }
[[ $client_rc -eq 0 ]] || { echo "FAIL: client exited $client_rc"; ok=0; }
[[ $server_rc -eq 0 ]] || { echo "FAIL: server exited $server_rc"; ok=0; }
grep -q '^client: .*equal' "$dir/client.out" ||
  { echo "FAIL: no client line"; ok=0; }
grep -q '^server: .*verified' "$dir/server.out" ||
  { echo "FAIL: no server line"; ok=0; }
[[ $ok -eq 1 ]]
