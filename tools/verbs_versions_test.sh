#!/bin/bash
# Ferry's binaries start on an older libibverbs than Debian 12's: what
# they need of it is at most version node IBVERBS_1.8 (rdma-core 28), the
# newer calls being found at run time (transport/rdma/verbs_compat.h). A
# direct call of, say, ibv_is_fork_initialized would add IBVERBS_1.13, and
# the loader would refuse the program before main on rdma-core 34 -- the
# doctor too, which is there to say the library is too old.
set -uo pipefail
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
for b in tools/transfer_bench tools/doctor; do
  # The version nodes the binary needs of libibverbs.so.1.
  nodes="$(readelf -V --wide "$RUNFILES/$b" | awk '
    /File: / { lib = ($0 ~ /File: libibverbs/) }
    lib && /Name: IBVERBS_/ { for (i = 1; i <= NF; i++) if ($i ~ /^IBVERBS_/) print $i }')"
  if [[ -z "$nodes" ]]; then
    fail "$b: needs nothing of libibverbs? (readelf found no node)"
    continue
  fi
  newest="$(sed 's/^IBVERBS_1\.//' <<<"$nodes" | sort -n | tail -1)"
  if ((newest > 8)); then
    fail "$b needs IBVERBS_1.$newest of libibverbs (nodes: $(tr '\n' ' ' <<<"$nodes")):"
    echo "  call that function through transport/rdma/verbs_compat.h"
  else
    pass "$b needs IBVERBS_1.$newest at most"
  fi
done
finish
