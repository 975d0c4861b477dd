#!/bin/bash
# Runs the commands of docs/quickstart.md as written: a first transfer over
# TCP, the same over RDMA on softrnic, and the two-host transfer on a
# tools/cluster. Takes the ```sh blocks that run transfer_bench or
# tools/cluster, with the build steps left out and only the paths mapped to
# this test's runfiles (bazel-bin/X -> the runfile X; tools/softrnic-run is
# told where softrnic's library is; tools/cluster gets --bin).
# Each must exit 0 and say "every byte verified". Needs root (namespaces).
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
PATH="$PATH:/usr/sbin:/sbin"
if [[ $(id -u) -ne 0 ]]; then
  abort "quickstart_test needs root (tools/cluster); run it as root"
fi

# One file per command: the doc's sh blocks, continuation lines joined.
/usr/bin/python3 - "$RUNFILES/docs/quickstart.md" "$tmp" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
n = 0
for block in re.findall(r"```sh\n(.*?)```", text, re.S):
    # A block is one command (a cluster's command spans lines inside its
    # quotes), once continuations are joined and build steps dropped.
    lines = [l.split("  #")[0].rstrip()
             for l in re.sub(r"\\\n", " ", block).splitlines()]
    cmd = "\n".join(l for l in lines if l and not l.startswith(
        ("bazel build", "git clone", "tools/dev.sh")))
    if "transfer_bench --mode" in cmd or cmd.startswith("tools/cluster"):
        n += 1
        open(f"{sys.argv[2]}/cmd{n}.sh", "w").write(cmd + "\n")
print(n, "commands")
PY
shopt -s nullglob
cmds=("$tmp"/cmd*.sh)
if ((${#cmds[@]} < 3)); then
  fail "expected 3 commands in docs/quickstart.md, found ${#cmds[@]}"
fi
for f in "${cmds[@]}"; do
  sed -i \
    -e "s|tools/softrnic-run bazel-bin/|FERRY_SOFTRNIC_LIB_DIR=$RUNFILES/transport/softrnic $RUNFILES/tools/softrnic-run $RUNFILES/|" \
    -e "s|^bazel-bin/|$RUNFILES/|" \
    -e "s|^tools/cluster |$RUNFILES/tools/cluster --bin $RUNFILES |" "$f"
  echo "== $(cat "$f")"
  if timeout 300 bash "$f" >"$f.out" 2>&1 &&
    grep -q "every byte verified" "$f.out"; then
    pass "${f##*/}: every byte verified"
  else
    fail "${f##*/}" "$f.out"
  fi
done
finish
