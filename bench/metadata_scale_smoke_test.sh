#!/bin/bash
# Runs metadata_scale_bench briefly (20 segments x 10 buffers, 10 watchers,
# the in-memory store behind a metadata_server child): its JSON report must
# have every field docs/performance.md quotes, every call and every watch
# event counted, and no failure. No timing is checked: CI machines are
# shared.
set -u
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
bench="$RUNFILES/bench/metadata_scale_bench"
out="$(timeout 60 "$bench" --segments=20 --buffers=10 --watchers=10 \
  --gets=40 --backend=memory --report=json \
  --metadata_server="$RUNFILES/tools/metadata_server" 2>"$tmp/err")"
rc=$?
if ((rc == 0)) && python3 - "$out" <<'PY'; then
import json, sys
r = json.loads(sys.argv[1].strip().splitlines()[-1])
for k in ("put", "get", "update", "watch"):
    for f in ("count", "failures", "p50_ms", "p99_ms", "max_ms"):
        assert f"{k}_{f}" in r, f"{k}_{f}"
    assert r[f"{k}_failures"] == 0, r
    assert 0 < r[f"{k}_p50_ms"] <= r[f"{k}_p99_ms"] <= r[f"{k}_max_ms"], r
assert r["put_count"] == 20 and r["get_count"] == 40, r
assert r["update_count"] == 10 and r["watch_count"] == 10, r
assert r["watch_streams"] == 10 and r["watch_stream_failures"] == 0, r
assert r["server_rss_mib"] > 0 and r["server_hwm_mib"] >= r["server_rss_mib"], r
assert r["failures"] == 0, r
PY
  pass "metadata_scale_bench, memory: $out"
else
  fail "metadata_scale_bench (exit $rc): $out" "$tmp/err"
fi
# A bad flag is refused with a message, not run.
if "$bench" --backend=nosuch >/dev/null 2>"$tmp/bad"; then
  fail "--backend=nosuch was accepted" "$tmp/bad"
elif grep -q "backend must be memory, durable or etcd" "$tmp/bad"; then
  pass "--backend=nosuch refused"
else
  fail "--backend=nosuch: no clear message" "$tmp/bad"
fi
finish
