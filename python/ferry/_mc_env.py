"""Mooncake's MC_* environment variables, read as Mooncake reads them
(mooncake-common's Environ), for ferry.mooncake.

Each variable either sets the Ferry option with its meaning, or is
reported once per process as ignored, saying why. docs/python.md carries
the same table.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Dict, List, Mapping, Optional, Set, Tuple

log = logging.getLogger("ferry.mooncake")

_TRUE = ("1", "true", "on", "yes")


def is_set(env: Mapping[str, str], name: str) -> bool:
    """Mooncake's GetBool: 1, true, on or yes, in any case."""
    return env.get(name, "").strip().lower() in _TRUE


def _int(v: str) -> int:
    return int(v.strip(), 0)


def _log_level(v: str) -> str:
    level = v.strip().lower()
    return {"warning": "warn", "fatal": "error"}.get(level, level)


def _topology(v: str) -> str:
    # Mooncake takes the matrix itself; a path to a file of it is read.
    v = v.strip()
    if v and not v.startswith("{") and os.path.isfile(v):
        with open(v, encoding="utf-8") as f:
            return f.read()
    return v


def _seconds_as_ms(v: str) -> str:
    return str(int(float(v) * 1000))


def _transfer_timeout(v: str) -> str:
    # Mooncake's binding: max(5, atoi(value)) seconds.
    try:
        seconds = int(v.strip())
    except ValueError:
        seconds = 0
    return str(max(5, seconds) * 1000)


# Variable -> (Ferry option, conversion to its string value). A value the
# conversion refuses is reported, and the option keeps its default.
_OPTIONS: Dict[str, Tuple[str, Callable[[str], object]]] = {
    "MC_GID_INDEX": ("rdma.gid_index", _int),
    "MC_IB_TC": ("rdma.traffic_class", _int),
    "MC_IB_SL": ("rdma.service_level", _int),
    "MC_MAX_INLINE": ("rdma.inline_bytes", _int),
    "MC_NUM_QP_PER_EP": ("rdma.qps_per_endpoint", _int),
    "MC_MAX_EP_PER_CTX": ("rdma.max_endpoints", _int),
    "MC_SLICE_SIZE": ("rdma.slice_bytes", _int),
    # Mooncake counts retries after the first try; Ferry counts tries.
    "MC_RETRY_CNT": ("rdma.max_attempts", lambda v: _int(v) + 1),
    "MC_RDMA_RAIL_PAUSE_SECONDS": ("rdma.pause_duration_ms", _seconds_as_ms),
    "MC_CUSTOM_TOPO_JSON": ("rdma.topology_json", _topology),
    "MC_MS_FILTERS": ("rdma.devices", str),
    "MC_TE_FILTERS": ("rdma.devices", str),
    "MC_TCP_SLICE_SIZE": ("tcp.max_slice_bytes", _int),
    "MC_TCP_BIND_ADDRESS": ("listen_host", str),
    "MC_HANDSHAKE_PORT": ("rpc_port", _int),
    "MC_TRANSFER_TIMEOUT": ("transfer_timeout_ms", _transfer_timeout),
    "MC_LOG_LEVEL": ("log_level", _log_level),
}

# Variables that choose the transport; handled by the shim's initialize.
TRANSPORT = ("MC_FORCE_TCP", "MC_FORCE_HCA")
REFUSE_UNVERIFIED = "FERRY_REFUSE_UNVERIFIED_NOTIFICATIONS"

# Variable -> why Ferry does without it.
_IGNORED: Dict[str, str] = {
    "MC_IB_PORT": "Ferry uses port 1 of each device",
    "MC_MTU": "Ferry uses the active MTU of both ports, agreed per "
              "connection (the path MTU)",
    "MC_MAX_WR": "Ferry sizes its queues from the device's limits",
    "MC_MAX_SGE": "Ferry sizes its queues from the device's limits",
    "MC_MAX_CQE_PER_CTX": "Ferry sizes its queues from the device's limits",
    "MC_NUM_CQ_PER_CTX": "Ferry polls one completion queue per NIC",
    "MC_NUM_COMP_CHANNELS_PER_CTX":
        "Ferry polls one completion queue per NIC",
    "MC_WORKERS_PER_CTX": "Ferry polls each NIC from one worker thread "
                          "(rdma.worker_threads sets how many in all)",
    "MC_IB_PCI_RELAXED_ORDERING": "Ferry registers memory without relaxed "
                                  "ordering",
    "MC_MS_AUTO_DISC": "Ferry always discovers the NICs (MC_MS_FILTERS "
                       "narrows them)",
    "MC_USE_IPV6": "Ferry takes IPv6 addresses wherever they are given",
    "MC_MIN_PRC_PORT": "Ferry listens on one port (MC_HANDSHAKE_PORT, or "
                       "any free one)",
    "MC_MAX_PRC_PORT": "Ferry listens on one port (MC_HANDSHAKE_PORT, or "
                       "any free one)",
    "MC_RDMA_BIND_ADDRESS": "Ferry's RDMA handshakes go through its RPC "
                            "listener (MC_TCP_BIND_ADDRESS binds it)",
    "MC_ENDPOINT_STORE_TYPE": "Ferry's endpoint store is always SIEVE",
    "MC_DISABLE_GPU_DIRECT_RDMA": "Ferry stages GPU memory through host "
                                  "memory only where a NIC cannot register "
                                  "it",
    "MC_HANDSHAKE_LISTEN_BACKLOG": "Ferry's handshakes are gRPC calls",
    "MC_HANDSHAKE_MAX_LENGTH": "Ferry's handshakes are gRPC calls",
    "MC_DISABLE_METACACHE": "Ferry caches descriptors and refreshes them "
                            "when a peer changes",
    "MC_ENABLE_PARALLEL_REG_MR": "Ferry registers buffers of 1 GiB or more "
                                 "on the NICs in parallel",
    "MC_FRAGMENT_RATIO": "Ferry slices requests by rdma.slice_bytes",
    "MC_PATH_ROUNDROBIN": "Ferry routes each slice by the NICs' load",
    "MC_ENABLE_DEST_DEVICE_AFFINITY": "Ferry routes each slice by the "
                                      "NICs' load and topology",
    "MC_SLICE_TIMEOUT": "Ferry bounds each request by MC_TRANSFER_TIMEOUT",
    "MC_LEGACY_RPC_PORT_BINDING": "Ferry listens on one port",
    "MC_LOG_DIR": "Ferry logs to standard error",
    "MC_YLT_LOG_LEVEL": "Ferry has no yalantinglibs RPC",
    "MC_RPC_PROTOCOL": "Ferry's control plane is gRPC",
    "MC_METADATA_CLUSTER_ID": "give Ferry a metadata_namespace instead",
}
# Mooncake's other transports and its store: nothing of Ferry's.
_OTHER = ("MC_FORCE_MNNVL", "MC_INTRA_NVLINK", "MC_INTRANODE_NVLINK",
          "MC_ENABLE_MNNVL", "MC_USE_NVLINK_IPC", "MC_CXL_", "MC_HIP_",
          "MC_USE_HIP_IPC", "MC_EFA_", "MC_REDIS_", "MC_STORE_", "MC_TENT_",
          "MC_USE_TENT", "MC_USE_TEV1", "MC_TE_METRIC", "MC_CUDART_LIBRARY",
          "MC_IMEX_")

_reported: Set[str] = set()
_reported_lock = threading.Lock()


def _report_once(name: str, message: str) -> None:
    with _reported_lock:
        if name in _reported:
            return
        _reported.add(name)
    log.warning("%s", message)


def options(env: Optional[Mapping[str, str]] = None
            ) -> List[Tuple[str, object]]:
    """The Ferry options the MC_* variables of `env` (default: the
    process's) give; reports, once each, those ignored and why."""
    env = os.environ if env is None else env
    out: List[Tuple[str, object]] = []
    for name in sorted(k for k in env if k.startswith("MC_")):
        value = env[name]
        if name in _OPTIONS:
            option, convert = _OPTIONS[name]
            # Mooncake's "unset" values.
            if name == "MC_IB_TC" and value.strip() == "-1":
                continue
            if name == "MC_HANDSHAKE_PORT" and value.strip() in ("", "0"):
                continue
            try:
                out.append((option, convert(value)))
            except (ValueError, OSError, OverflowError) as e:
                _report_once(name, f"{name}={value!r} ignored: not a value "
                                   f"for {option} ({e})")
        elif name in TRANSPORT:
            continue
        elif name in _IGNORED:
            _report_once(name, f"{name} is ignored: {_IGNORED[name]}")
        elif name.startswith(_OTHER):
            _report_once(name, f"{name} is ignored: it configures a part of "
                               "Mooncake that Ferry does not have (NVLink, "
                               "CXL, HIP, EFA, TENT or Mooncake Store)")
        else:
            _report_once(name, f"{name} is ignored: Ferry knows no such "
                               "Mooncake setting")
    # Ferry's own, for what initialize() cannot pass: receivers refuse
    # notifications whose claimed sender does not verify, unless this is
    # false (a sender that reaches them from another address than it
    # advertises: several interfaces, NAT).
    refuse = env.get(REFUSE_UNVERIFIED, "").strip()
    if refuse:
        out.append(("refuse_unverified_notifications",
                     "1" if is_set(env, REFUSE_UNVERIFIED) else "0"))
    return out
