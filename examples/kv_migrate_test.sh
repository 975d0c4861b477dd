#!/bin/bash
# examples/kv_migrate.py, two processes, as CI runs it: over TCP and over
# RDMA (softrnic) in P2P mode, and over TCP with a metadata_server. The
# decode process must check every block and find none bad.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
LIBDIR="$RUNFILES/transport/softrnic"
MDS="$RUNFILES/tools/metadata_server"
pkg="$tmp/pkg"
mkdir -p "$pkg/ferry"
cp "$RUNFILES"/python/ferry/*.py "$RUNFILES/python/_ferry.so" "$pkg/ferry/"
# shellcheck source=../bazel/sanitizer_preload.sh
source "$RUNFILES/bazel/sanitizer_preload.sh"
preload="$(sanitizer_preload "$pkg/ferry/_ferry.so")"
export ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0"
py() {
  LD_PRELOAD="$preload" LD_LIBRARY_PATH="$LIBDIR" PYTHONPATH="$pkg" \
    timeout 120 /usr/bin/python3 "$RUNFILES/examples/kv_migrate.py" "$@"
}

migrate() {  # label, then flags for both sides; decode flags after --
  local label=$1 name_file="$tmp/$1.name"
  shift
  local common=() decode=() prefill=()
  while (($# > 0)) && [[ $1 != "--" ]]; do common+=("$1"); shift; done
  shift
  while (($# > 0)) && [[ $1 != "--" ]]; do decode+=("$1"); shift; done
  shift
  prefill=("$@")
  rm -f "$name_file"
  py decode "${common[@]}" "${decode[@]}" --name-file="$name_file" \
    >"$tmp/$label-decode.log" 2>&1 &
  local dpid=$!
  pids+=($dpid)
  local waited=0
  while [[ ! -s $name_file ]] && ((waited < 300)); do
    sleep 0.1
    waited=$((waited + 1))
  done
  py prefill "${common[@]}" "${prefill[@]}" --peer="$(cat "$name_file" 2>/dev/null)" \
    >"$tmp/$label-prefill.log" 2>&1
  local rc_p=$?
  wait "$dpid"
  local rc_d=$?
  if ((rc_p == 0 && rc_d == 0)) && grep -q " 0 bad" "$tmp/$label-decode.log"; then
    pass "$label: $(cat "$tmp/$label-decode.log" | tail -1)"
  else
    fail "$label (prefill exit $rc_p, decode exit $rc_d)" \
      "$tmp/$label-prefill.log" "$tmp/$label-decode.log"
  fi
}

migrate tcp-p2p --metadata=P2PHANDSHAKE --protocol=tcp -- --
migrate rdma-p2p --metadata=P2PHANDSHAKE --protocol=rdma -- --

port=$(free_port)
"$MDS" --listen="127.0.0.1:$port" >"$tmp/md.log" 2>&1 &
pids+=($!)
wait_for "$tmp/md.log" "listening" || fail "metadata_server did not start" "$tmp/md.log"
migrate tcp-metadata-server --metadata="127.0.0.1:$port" --protocol=tcp \
  -- --name="127.0.0.1:$(free_port)" -- --name="127.0.0.1:$(free_port)"

finish
