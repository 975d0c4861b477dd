#!/bin/bash
# tools/doctor on softrnic: a healthy set-up passes; each broken one is
# flagged with its fix and a non-zero exit status.
#   1. default profile: every check OK, exit 0, valid JSON;
#   2. "roce-1500" (a RoCE port on a 1500-byte netdev, link-local and
#      RoCE v1 GIDs first): the MTU is a warning with its fix, and the GID
#      picked is the IPv4-mapped RoCE v2 entry (index 3), v1 skipped;
#   3. a device that cannot be opened (its address is not this host's);
#   4. a port with RoCE v1 GIDs only;
#   5. a locked-memory limit too small for the registration planned,
#      without CAP_IPC_LOCK;
#   6. rdma-core's own libibverbs (no softrnic): its release is named, and
#      a host with no RDMA device fails with the fix;
#   7. "mlx5-ib" (InfiniBand): ACTIVE with a LID, no GID needed; and the
#      same port with no subnet manager (no LID: INIT) fails with the fix;
#   8. a GID index pinned past the table fails; pinned to RoCE v1, warns.
set -u
# shellcheck source=../testing/test_lib.sh
source "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-ferry}/testing/test_lib.sh"
DOCTOR="$RUNFILES/tools/doctor"
export LD_LIBRARY_PATH="$RUNFILES/transport/softrnic"
asan_rt="$(ldd "$LD_LIBRARY_PATH/libibverbs.so.1" | awk '/libasan/ {print $3}')"
[[ -n "$asan_rt" ]] && export ASAN_OPTIONS="detect_leaks=0"
OUT="$tmp"
export FERRY_SOFTRNIC_SUBNET="$OUT/softrnic-subnet"

json() {  # file, python expression over the parsed report `r`
  python3 - "$1" "$2" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
c = {x["name"]: x for x in r["checks"]}
sys.exit(0 if eval("(" + sys.argv[2] + ")") else 1)
PY
}

# expect CODE FILE EXPR WHAT: the doctor just run (exit status in $rc)
# exited with CODE and its JSON report in FILE satisfies EXPR.
expect() {
  if ((rc == $1)) && json "$2" "$3"; then
    pass "$4"
  else
    fail "$4 (exit $rc)" "$2"
  fi
}

FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 "$DOCTOR" --json >"$OUT/ok.json" 2>&1
rc=$?
expect 0 "$OUT/ok.json" 'r["fails"] == 0 and c["softrnic0 GID"]["detail"].startswith("index 0")' \
  "healthy softrnic: all OK"

FERRY_SOFTRNIC_PROFILE=roce-1500 FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 \
  "$DOCTOR" --json >"$OUT/roce.json" 2>&1
rc=$?
expect 0 "$OUT/roce.json" 'c["softrnic0 MTU"]["level"] == "WARN" and "mtu 9000" in c["softrnic0 MTU"]["fix"]
     and c["softrnic0 GID"]["detail"].startswith("index 3")
     and "RoCE v1 skipped" in c["softrnic0 GID"]["detail"]
     and "RoCE v1" in c["softrnic0 GID table"]["detail"]' \
  "roce-1500: MTU 1024 warned with its fix; RoCE v2 GID picked, v1 skipped"

FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1,softrnic9=192.0.2.1 \
  "$DOCTOR" --json >"$OUT/dead.json" 2>/dev/null
rc=$?
expect 1 "$OUT/dead.json" 'c["softrnic9"]["level"] == "FAIL" and c["softrnic9"]["fix"] and r["fails"] == 1' \
  "a device that cannot be opened fails, with a fix"

FERRY_SOFTRNIC_PROFILE=roce-v1-only FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 \
  "$DOCTOR" --json >"$OUT/v1.json" 2>&1
rc=$?
expect 1 "$OUT/v1.json" 'c["softrnic0 GID"]["level"] == "FAIL" and "only RoCE v1" in c["softrnic0 GID"]["detail"]
     and "RoCE v2" in c["softrnic0 GID"]["fix"]' \
  "a port with RoCE v1 GIDs only fails, with the fix"

# A pinned GID index (MC_GID_INDEX, as Mooncake reads it): one past the
# table fails as Ferry's Init would; a RoCE v1 entry is a warning.
MC_GID_INDEX=7 FERRY_SOFTRNIC_PROFILE=roce-1500 FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 \
  "$DOCTOR" --json >"$OUT/pin7.json" 2>&1
rc=$?
expect 1 "$OUT/pin7.json" 'c["softrnic0 GID"]["level"] == "FAIL" and "no GID index 7 (port 1 has 4 entries" in c["softrnic0 GID"]["detail"]
     and "unset MC_GID_INDEX" in c["softrnic0 GID"]["fix"]' \
  "MC_GID_INDEX past the GID table fails, with the fix"
MC_GID_INDEX=2 FERRY_SOFTRNIC_PROFILE=roce-1500 FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 \
  "$DOCTOR" --json >"$OUT/pin2.json" 2>&1
rc=$?
expect 0 "$OUT/pin2.json" 'c["softrnic0 GID"]["level"] == "WARN" and "a RoCE v1 entry" in c["softrnic0 GID"]["detail"]
     and "RoCE v2" in c["softrnic0 GID"]["fix"]' \
  "MC_GID_INDEX on a RoCE v1 entry is a warning, with the fix"

if compgen -G "/sys/class/infiniband/*" >/dev/null; then
  echo "SKIP: rdma-core's libibverbs on a host with RDMA devices (the case needs none)"
else
  LD_LIBRARY_PATH= "$DOCTOR" --json >"$OUT/rdmacore.json" 2>/dev/null
  rc=$?
  expect 1 "$OUT/rdmacore.json" '__import__("re").match(r"rdma-core \d+\.\d+, ", c["verbs library"]["detail"])
       and c["verbs library"]["level"] != "FAIL"
       and c["devices"]["level"] == "FAIL" and "softrnic-run" in c["devices"]["fix"]' \
    "rdma-core's libibverbs: release named; no RDMA device fails, with the fix"
fi

FERRY_SOFTRNIC_PROFILE=mlx5-ib FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 \
  "$DOCTOR" --json >"$OUT/ib.json" 2>&1
rc=$?
expect 0 "$OUT/ib.json" 'r["fails"] == 0 and "InfiniBand, LID " in c["softrnic0 port 1"]["detail"]
     and c["softrnic0 GID"]["detail"].startswith("not needed")' \
  "mlx5-ib: ACTIVE InfiniBand port with a LID; no GID needed"
# No subnet table can be written: no subnet manager, no LID.
FERRY_SOFTRNIC_SUBNET=/proc/no-subnet-manager FERRY_SOFTRNIC_PROFILE=mlx5-ib \
  FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 \
  "$DOCTOR" --json >"$OUT/nosm.json" 2>/dev/null
rc=$?
expect 1 "$OUT/nosm.json" 'c["softrnic0 port 1"]["level"] == "FAIL" and "INIT" in c["softrnic0 port 1"]["detail"]
     and "opensm" in c["softrnic0 port 1"]["fix"]' \
  "mlx5-ib with no subnet manager: the port in INIT fails, with the fix"

if ! command -v setpriv >/dev/null || [[ $(id -u) -ne 0 ]]; then
  fail "needs root and setpriv (util-linux) to drop CAP_IPC_LOCK"
else
  FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1 setpriv \
    --bounding-set=-ipc_lock --inh-caps=-ipc_lock bash -c \
    "ulimit -l 1024 && exec '$DOCTOR' --json --register_bytes=$((64 << 20))" \
    >"$OUT/memlock.json" 2>&1
  rc=$?
  expect 1 "$OUT/memlock.json" 'c["memlock"]["level"] == "FAIL" and "ulimit -l unlimited" in c["memlock"]["fix"]
       and "1048576" in c["memlock"]["detail"]' \
    "a 1 MiB memlock limit without CAP_IPC_LOCK fails, with the fix"
fi

# 9. GPUs on softgpu, numbered against PCI order, and a fake sysfs tree
#    that puts each soft NIC beside one GPU: the driver, the GPUs, GPUDirect
#    readiness and the affinity matrix by the driver's ordinals; then a
#    driver with no dma-buf and no nvidia-peermem: a warning, with the fix.
#    (Above, with no libcuda.so.1 on the path, "CUDA driver" was OK: host
#    memory needs none.)
SYS="$OUT/sys"
device() {  # PATH CLASS VENDOR NUMA
  mkdir -p "$SYS/devices/$1" "$SYS/bus/pci/devices"
  echo "$2" >"$SYS/devices/$1/class"
  echo "$3" >"$SYS/devices/$1/vendor"
  echo "$4" >"$SYS/devices/$1/numa_node"
  ln -s "$SYS/devices/$1" "$SYS/bus/pci/devices/${1##*/}"
}
device pci0000:00/0000:00:01.0/0000:01:00.0 0x030200 0x10de 0
device pci0000:00/0000:00:01.0/0000:01:01.0 0x020700 0x15b3 0
device pci0000:80/0000:80:01.0/0000:81:00.0 0x030200 0x10de 1
device pci0000:80/0000:80:01.0/0000:81:01.0 0x020700 0x15b3 1
mkdir -p "$SYS/class/infiniband/softrnic0" "$SYS/class/infiniband/softrnic1"
ln -s "$SYS/devices/pci0000:00/0000:00:01.0/0000:01:01.0" "$SYS/class/infiniband/softrnic0/device"
ln -s "$SYS/devices/pci0000:80/0000:80:01.0/0000:81:01.0" "$SYS/class/infiniband/softrnic1/device"
GPU_ENV=(env LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$RUNFILES/gpu/softgpu"
  FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1,softrnic1=127.0.0.2
  FERRY_SOFTGPU_DEVICES=0000:81:00.0,0000:01:00.0)
"${GPU_ENV[@]}" "$DOCTOR" --json --sysfs_root="$SYS" \
  --register_bytes=$((1 << 20)) >"$OUT/gpu.json" 2>&1
rc=$?
expect 0 "$OUT/gpu.json" 'r["fails"] == 0 and c["CUDA driver"]["level"] == "OK"
     and "cuda:0 Ferry softgpu at 0000:81:00.0" in c["GPUs"]["detail"]
     and c["GPUDirect RDMA"]["level"] == "OK"
     and "cuda:0: softrnic0 SYS, softrnic1 NEAR; cuda:1: softrnic0 NEAR, softrnic1 SYS" in c["GPU-NIC affinity"]["detail"]
     and "\"cuda:0\": [[\"softrnic1\"]" in c["NIC priority matrix"]["detail"]' \
  "GPUs: driver, devices, GPUDirect ready, affinity by the driver's ordinals"
"${GPU_ENV[@]}" FERRY_SOFTGPU_DMABUF=0 "$DOCTOR" --json --sysfs_root="$SYS" \
  --register_bytes=$((1 << 20)) >"$OUT/nodmabuf.json" 2>&1
rc=$?
expect 0 "$OUT/nodmabuf.json" 'c["GPUDirect RDMA"]["level"] == "WARN" and "nvidia-peermem" in c["GPUDirect RDMA"]["fix"]
     and "stages it" in c["GPUDirect RDMA"]["detail"]' \
  "no dma-buf and no peermem: GPUDirect RDMA warned, with the fix"

finish
