#!/bin/bash
# The docs cannot drift from the code (devtools/docs_check/): quoted
# messages against the sources' string literals, flags against each
# program's --helpfull, the Chinese edition against its English pages,
# and the console blocks marked runnable, run on softrnic. Reads the
# source tree itself (found through mkdocs.yml's runfile), like site_test.
set -uo pipefail
RUNFILES="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}"
root="$(dirname "$(readlink -f "$RUNFILES/mkdocs.yml")")"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
helpfull=()
for p in transfer_bench metadata_server doctor; do
  # --helpfull exits 1 by absl's convention: the text is what counts.
  "$RUNFILES/tools/$p" --helpfull >"$tmp/$p.txt" 2>&1
  if ! grep -q -- '^    --' "$tmp/$p.txt"; then
    echo "FAIL: $p --helpfull printed no flags"
    head -5 "$tmp/$p.txt" | sed 's/^/  | /'
    echo "0 passed, 1 failed"
    exit 1
  fi
  helpfull+=(--helpfull "$p=$tmp/$p.txt")
done
# The runnable blocks run in a scratch directory with the repository's
# paths mapped to the runfiles (bazel-bin/X, tools/softrnic-run).
exec /usr/bin/python3 "$RUNFILES/devtools/docs_check" --root "$root" \
  --runfiles "$RUNFILES" "${helpfull[@]}"
