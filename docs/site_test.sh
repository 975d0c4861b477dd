#!/bin/bash
# Builds the site with --strict and opens every page in headless Chromium
# (devtools/site check): navigation, highlighted code, no broken link.
set -euo pipefail
yml="$(readlink -f "$TEST_SRCDIR/$TEST_WORKSPACE/mkdocs.yml")"
root="$(dirname "$yml")"
"$root/devtools/site" check "$TEST_TMPDIR/site"
