#!/bin/bash
# The docs cannot drift from the code (devtools/docs_check/): quoted
# messages against the sources' string literals, flags against each
# program's --helpfull, the Chinese edition against its English pages,
# and the console blocks marked runnable, run on softrnic. Reads the
# source tree itself (found through mkdocs.yml's runfile), like site_test.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
root="$(dirname "$(readlink -f "$RUNFILES/mkdocs.yml")")"
helpfull=()
for p in transfer_bench metadata_server doctor; do
  # --helpfull exits 1 by absl's convention: the text is what counts.
  "$RUNFILES/tools/$p" --helpfull >"$tmp/$p.txt" 2>&1
  grep -q -- '^    --' "$tmp/$p.txt" ||
    abort "$p --helpfull printed no flags" "$tmp/$p.txt"
  helpfull+=(--helpfull "$p=$tmp/$p.txt")
done
# The runnable blocks run in a scratch directory with the repository's
# paths mapped to the runfiles (bazel-bin/X, tools/softrnic-run). The
# checker prints each check's verdict and its problems.
if /usr/bin/python3 "$RUNFILES/devtools/docs_check" --root "$root" \
  --runfiles "$RUNFILES" "${helpfull[@]}"; then
  pass "docs_check"
else
  fail "docs_check (its problems are above)"
fi
finish
