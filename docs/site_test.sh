#!/bin/bash
# Builds the site with --strict and opens every page in headless Chromium
# (devtools/site check): navigation, highlighted code, no broken link.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
root="$(dirname "$(readlink -f "$RUNFILES/mkdocs.yml")")"
if "$root/devtools/site" check "$tmp/site"; then
  pass "the site builds strictly and every page renders"
else
  fail "devtools/site check (its output is above)"
fi
finish
