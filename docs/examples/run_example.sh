#!/bin/bash
# Runs a docs example and fails if it exits non-zero or prints nothing.
set -euo pipefail
out="$("$1")"
echo "$out"
[[ -n "$out" ]]
