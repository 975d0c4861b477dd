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
expect() {  # name, pass or the reason the check must give, edges...
  local name="$1" want="$2"
  shift 2
  graph "$@" >"$tmp/g.dot"
  run "$name" "$want"
}
run() {  # name, pass or reason: checks $tmp/g.dot
  local name="$1" want="$2"
  if /usr/bin/python3 "$script" --graph "$tmp/g.dot" >"$tmp/out" 2>&1; then
    if [[ "$want" == pass ]] && grep -q "^1 passed, 0 failed$" "$tmp/out"; then
      pass "$name: passes"
    else
      fail "$name: passed, wanted '$want'" "$tmp/out"
    fi
  elif [[ "$want" != pass ]] && grep -q "^0 passed, 1 failed$" "$tmp/out" &&
    grep -q -- "$want" "$tmp/out"; then
    pass "$name: refused ($want)"
  else
    fail "$name: wanted '$want'" "$tmp/out"
  fi
}

expect "downward edges" pass "//engine //transport/registry" \
  "//transport/registry //transport/rdma" "//transport/rdma //transport" \
  "//metadata/address //metadata/etcd" "//metadata/etcd //metadata"
expect "an edge upward" "//metadata -> //metadata/etcd: an edge upward" \
  "//metadata //metadata/etcd"
expect "an edge sideways" "//transport/rdma -> //transport/tcp: an edge sideways" \
  "//transport/rdma //transport/tcp"
expect "a package not placed" "//newpkg: not in" "//engine //newpkg"
# A cycle among packages not placed (placed ones cannot form one without
# an edge upward): only the cycle check sees it.
expect "a cycle" "cycle: //newa -> //newb -> //newa" "//newa //newb" \
  "//newb //newa"
# Layers allow it, the stacks do not: a transport using the metadata plane.
expect "transport and metadata meet" "must not meet" \
  "//transport/rdma //metadata"
# Names inside one node ("a\nb", as bazel may group them) are each read:
# only the second name's edge is wrong.
printf 'digraph g {\n  "//engine:a\\n//common:b" -> "//transport:c"\n}\n' >"$tmp/g.dot"
run "grouped node names" "//common -> //transport: an edge upward"
finish
