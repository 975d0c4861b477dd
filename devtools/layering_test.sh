#!/usr/bin/env bash
# devtools/layering.py on made-up package graphs: a clean one passes; a
# cycle, an edge upward, an edge sideways and an unplaced package fail.
# (CI runs it on the real graph: tools/dev.sh layering.)
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
script="$RUNFILES/devtools/layering.py"

graph() {  # edges "a b" ... -> a graph in bazel query's --output=graph form
  echo "digraph mygraph {"
  for e in "$@"; do
    echo "  \"${e% *}:x\" -> \"${e#* }:y\""
  done
  echo "}"
}
expect() {  # name, pass|fail, edges...
  local name="$1" want="$2"
  shift 2
  graph "$@" >"$tmp/g.dot"
  if /usr/bin/python3 "$script" --graph "$tmp/g.dot" >"$tmp/out" 2>&1; then
    got=pass
  else
    got=fail
  fi
  if [[ "$got" == "$want" ]]; then
    pass "$name: $want"
  else
    fail "$name: wanted $want, got $got: $(cat "$tmp/out")"
  fi
}

expect "downward edges" pass "//engine //transport/registry" \
  "//transport/registry //transport/rdma" "//transport/rdma //transport" \
  "//metadata/address //metadata/etcd" "//metadata/etcd //metadata"
expect "a cycle" fail "//transport //transport/rdma" "//transport/rdma //transport"
expect "an edge upward" fail "//metadata //metadata/etcd"
expect "an edge sideways" fail "//transport/rdma //transport/tcp"
expect "a package not placed" fail "//engine //newpkg"
# Names inside one node ("a\nb", as bazel groups them) are each an edge.
printf 'digraph g {\n  "//common:a\\n//transport:b" -> "//engine:c"\n}\n' >"$tmp/g.dot"
check "grouped node names are read" \
  bash -c "! /usr/bin/python3 '$script' --graph '$tmp/g.dot' >/dev/null"
finish
