#!/bin/bash
# Concatenates the lcov reports listed in --reports_file into --output_file.
set -euo pipefail
reports="" out=""
for arg in "$@"; do
  case "$arg" in
    --reports_file=*) reports="${arg#*=}" ;;
    --output_file=*) out="${arg#*=}" ;;
  esac
done
[[ -n "$reports" && -n "$out" ]] || { echo "usage: --reports_file=F --output_file=F" >&2; exit 2; }
: > "$out"
while read -r f; do [[ -f "$f" ]] && cat "$f" >> "$out"; done < "$reports"
