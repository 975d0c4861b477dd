"""A drop-in for Mooncake TE's Python API (`mooncake.engine`).

A script written for Mooncake runs unchanged once

    from mooncake.engine import TransferEngine, TransferOpcode, TransferNotify

becomes

    from ferry.mooncake import TransferEngine, TransferOpcode, TransferNotify

Methods keep Mooncake's names, argument order, defaults and return
conventions (ints: 0 or negative; batch ids). Differences, each for a
reason, are listed in docs/python.md.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import logging
import operator
import os
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ferry import _ferry, _mc_env
from ferry.errors import FerryError

# Every failure a call reports as -1 is logged here, with its reason
# (Python's logging prints warnings to stderr unless configured).
log = logging.getLogger("ferry.mooncake")

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "Read",
           "Write", "SUPPORT_CUDA"]

# The *_on_cuda calls work wherever a CUDA driver is present (loaded at run
# time: Ferry has no build-time CUDA dependency); they raise where none is.
SUPPORT_CUDA = True

_P2P = "P2PHANDSHAKE"
# Transfer states (ferry_c.h).
_WAITING, _PENDING, _COMPLETED, _FAILED, _TIMEOUT = range(5)
_STATE_NAMES = {_WAITING: "WAITING", _PENDING: "PENDING",
                _COMPLETED: "COMPLETED", _FAILED: "FAILED",
                _TIMEOUT: "TIMEOUT"}


class TransferOpcode(enum.IntEnum):
    """Mooncake's binding spells them Read/Write; its docs, READ/WRITE."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification: sent with a transfer (`notify=`), or received.

    A received one also carries `sender`, the segment that sent it, and
    `verified`. Ferry checks the sender (by default the engine refuses
    notifications that the claimed sender did not sign with the identity key
    it publishes, so every one received is verified and a receiver can act on
    it); with refuse_unverified_notifications turned off, an unverified one
    is delivered with verified=False. Mooncake's TransferNotify has neither
    field."""

    def __init__(self, name: str = "", msg: str = "", sender: str = "",
                 verified: bool = True):
        self.name = name
        self.msg = msg
        self.sender = sender
        self.verified = verified

    def __repr__(self) -> str:
        extra = f", sender={self.sender!r}" if self.sender else ""
        if not self.verified:
            extra += ", verified=False"
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r}{extra})"


def _batch_id(value: object) -> Optional[int]:
    """A batch id as an int, or None for what cannot be one (a failed
    submission's -1, 0, anything that is not an integer)."""
    try:
        batch = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    return batch if 0 < batch < 1 << 64 else None


def _host_of(local_hostname: str) -> str:
    """The host of "host", "host:port", "[v6]:port" or a bare IPv6 address."""
    if local_hostname.startswith("["):
        return local_hostname[1:].partition("]")[0]
    if local_hostname.count(":") == 1:
        return local_hostname.partition(":")[0]
    return local_hostname  # A name, an IPv4 address, or a bare IPv6 one.


def _session(name: str) -> str:
    """A P2P peer's session id as Ferry names P2P segments: "host:port"
    with an unbracketed IPv6 host ("::1:37739", as SGLang's older wrapper
    and vLLM write it) split at the last colon and bracketed, as Mooncake's
    parseHostNameWithPort does; like it, a whole IPv6 address is left
    alone."""
    if name.startswith("[") or name.count(":") < 2:
        return name
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    host, _, port = name.rpartition(":")
    return f"[{host}]:{port}" if port.isdigit() else name


def _choose_transport(protocol: str, device_name: str,
                      env: Dict[str, str]) -> Tuple[str, str]:
    """The transport and RDMA devices for initialize's `protocol` and
    `device_name`, as Mooncake's binding chooses since April 2025: RDMA
    when the host has a NIC, TCP otherwise; MC_FORCE_TCP forces TCP and
    MC_FORCE_HCA RDMA. Each fallback is logged with its reason."""
    if _mc_env.is_set(env, "MC_FORCE_TCP"):
        if protocol not in ("tcp", ""):
            log.warning("MC_FORCE_TCP is set: using TCP, not %s", protocol)
        return "tcp", ""
    if protocol == "tcp":
        return "tcp", ""
    if protocol not in ("rdma", ""):
        log.warning("protocol %r is not one Ferry has (rdma, tcp): choosing "
                    "as for rdma", protocol)
    if _mc_env.is_set(env, "MC_FORCE_HCA"):
        return "rdma", device_name
    # Mooncake discovers only the devices named (device_name, else its
    # filter variables): none of those here is no RDMA, so TCP.
    wanted = device_name or env.get("MC_MS_FILTERS") or env.get(
        "MC_TE_FILTERS", "")
    try:
        _ferry.local_topology(wanted)
        return "rdma", device_name
    except FerryError as e:
        why = e.message
    log.warning("no RDMA device here%s (%s): using TCP",
                f" among {wanted!r}" if wanted else "", why)
    return "tcp", ""


def _metadata_endpoint(server: str, metadata_type: str = "") -> str:
    """Mooncake's metadata strings as Ferry's metadata addresses."""
    if server == _P2P or metadata_type.lower() in ("p2p", "p2phandshake"):
        return _P2P
    if "://" in server:
        return server
    if metadata_type:
        return f"{metadata_type}://{server}"
    return server  # host:port: Ferry's own metadata service.


class TransferEngine:
    """Mooncake's TransferEngine on Ferry."""

    def __init__(self) -> None:
        self._engine: Optional[_ferry.Engine] = None
        self._lock = threading.Lock()
        self._segments: Dict[str, int] = {}
        # Managed buffers (address -> length); the engine pins them.
        self._managed: Dict[int, int] = {}
        self._p2p = False

    # ---- set-up ----------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str,
                   protocol: str, device_name: str) -> int:
        return self.initialize_ext(local_hostname, metadata_server, protocol,
                                   device_name, "")

    def initialize_ext(self, local_hostname: str, metadata_server: str,
                       protocol: str, device_name: str,
                       metadata_type: str) -> int:
        endpoint = _metadata_endpoint(metadata_server, metadata_type)
        host = _host_of(local_hostname)
        env = dict(os.environ)
        transport, devices = _choose_transport(protocol, device_name, env)
        # MC_* first: initialize's own arguments win over them.
        options: List[Tuple[str, str]] = [
            (k, str(v)) for k, v in _mc_env.options(env)]
        # Listen on every interface (as Mooncake does); tell peers `host`.
        options += [("metadata_endpoint", endpoint),
                    ("advertise_host", host),
                    ("transports", transport)]
        if endpoint != _P2P:
            options.append(("local_segment_name", local_hostname))
        if devices and transport == "rdma":
            options.append(("rdma.devices", devices))
        self._close()  # Initialized again: a new engine, nothing cached.
        try:
            self._engine = _ferry.Engine(options)
        except FerryError as e:
            log.error("initialize(%r, %r, %r, %r) failed: %s", local_hostname,
                      metadata_server, protocol, device_name, e)
            return -1
        self._p2p = endpoint == _P2P
        return 0

    def _close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        with self._lock:
            self._segments.clear()
            self._managed.clear()

    def get_rpc_port(self) -> int:
        if self._engine is None:
            return -1
        return int(self._engine.rpc_address().rpartition(":")[2])

    # ---- buffers ---------------------------------------------------------

    def allocate_managed_buffer(self, length: int) -> int:
        """A buffer of `length` bytes, registered; its address (0: failed)."""
        if self._engine is None or length <= 0:
            return 0
        buf = (ctypes.c_char * length)()
        addr = ctypes.addressof(buf)
        try:
            self._engine.register(addr, length, "*", True)
            # The engine keeps the buffer alive until it is freed here or
            # the engine itself is gone (a call on another thread may still
            # hold it after close): peers may WRITE into it until then.
            self._engine.pin(addr, buf)
        except FerryError as e:
            log.warning("allocate_managed_buffer(%d) failed: %s", length, e)
            return 0
        with self._lock:
            self._managed[addr] = length
        return addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        with self._lock:
            managed = buffer_addr in self._managed
        if not managed or self._engine is None:
            log.warning("free_managed_buffer(0x%x): %s", buffer_addr,
                        "not a managed buffer" if self._engine is not None
                        else "the engine is not initialized")
            return -1
        try:
            self._engine.unregister(buffer_addr)
        except FerryError as e:
            log.warning("free_managed_buffer(0x%x) failed: %s", buffer_addr, e)
            return -1
        with self._lock:
            self._managed.pop(buffer_addr, None)
        self._engine.unpin(buffer_addr)
        return 0

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The lowest address among the segment's buffers (0: none); Ferry's
        descriptors keep buffers by address, not in registration order."""
        if self._engine is None:
            return 0
        try:
            handle = self._segment(segment_name)
            buffers = self._engine.segment_buffers(handle)
        except FerryError as e:
            log.warning("get_first_buffer_address(%r) failed: %s",
                        segment_name, e)
            return 0
        return buffers[0][0] if buffers else 0

    @staticmethod
    def write_bytes_to_buffer(dest_address: int, src_ptr: Union[bytes, str],
                              length: int) -> int:
        # Mooncake's binding takes a char*, so str as well as bytes.
        data = (src_ptr.encode() if isinstance(src_ptr, str) else
                bytes(src_ptr))
        if length > len(data) or length < 0:
            return -1
        ctypes.memmove(dest_address, data, length)
        return 0

    @staticmethod
    def read_bytes_from_buffer(source_address: int, length: int) -> bytes:
        return ctypes.string_at(source_address, length)

    # ---- registration ----------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int,
                        location: str = "*") -> int:
        return self._call(lambda e: e.register(buffer_addr, capacity,
                                               location, True))

    def unregister_memory(self, buffer_addr: int) -> int:
        return self._call(lambda e: e.unregister(buffer_addr))

    def batch_register_memory(self, buffer_addresses: Sequence[int],
                              capacities: Sequence[int],
                              location: str = "*") -> int:
        if len(buffer_addresses) != len(capacities):
            return -1
        return self._call(lambda e: e.register_batch(
            list(buffer_addresses), list(capacities), location, True))

    def batch_unregister_memory(self,
                                buffer_addresses: Sequence[int]) -> int:
        return self._call(
            lambda e: e.unregister_batch(list(buffer_addresses)))

    # ---- transfers -------------------------------------------------------

    def transfer_sync_write(self, target_hostname: str, buffer: int,
                            peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        return self.transfer_sync(target_hostname, buffer,
                                  peer_buffer_address, length, Write)

    def transfer_sync_read(self, target_hostname: str, buffer: int,
                           peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        return self.transfer_sync(target_hostname, buffer,
                                  peer_buffer_address, length, Read)

    def transfer_sync(self, target_hostname: str, buffer: int,
                      peer_buffer_address: int, length: int,
                      opcode: TransferOpcode,
                      notify: Optional[TransferNotify] = None,
                      transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, [buffer],
                                        [peer_buffer_address], [length],
                                        opcode, notify)

    def batch_transfer_sync_write(self, target_hostname: str,
                                  buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, buffers,
                                        peer_buffer_addresses, lengths, Write)

    def batch_transfer_sync_read(self, target_hostname: str,
                                 buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int],
                                 lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, buffers,
                                        peer_buffer_addresses, lengths, Read)

    def batch_transfer_sync(self, target_hostname: str,
                            buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int],
                            lengths: Sequence[int], opcode: TransferOpcode,
                            notify: Optional[TransferNotify] = None,
                            transport_hint: str = "") -> int:
        if self._engine is None or not (len(buffers) == len(
                peer_buffer_addresses) == len(lengths)) or len(buffers) == 0:
            log.warning("transfer to %r refused: %s", target_hostname,
                        "the engine is not initialized" if self._engine is None
                        else "buffers, peer addresses and lengths must be "
                        "non-empty lists of one length")
            return -1
        try:
            # One call for the whole batch (submit, wait, free): the Python
            # overhead per batch is then a few microseconds.
            state, total, _, failed, _ = self._engine.transfer_same(
                int(opcode), self._segment(target_hostname), buffers,
                peer_buffer_addresses, lengths)
        except FerryError as e:
            log.warning("transfer to %r failed: %s", target_hostname, e)
            return -1
        if state != _COMPLETED:
            log.warning("transfer to %r ended %s: %d of %d requests failed "
                        "(the engine's log says why)", target_hostname,
                        _STATE_NAMES.get(state, state), failed, total)
            return -1
        if notify is not None:
            try:
                self._engine.notify(self._segment(target_hostname),
                                    notify.name, notify.msg.encode())
            except FerryError as e:
                log.warning("notify to %r failed: %s", target_hostname, e)
                return -1
        return 0

    def batch_transfer_async_write(self, target_hostname: str,
                                   buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int],
                                   lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, buffers,
                                         peer_buffer_addresses, lengths, Write)

    def batch_transfer_async_read(self, target_hostname: str,
                                  buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, buffers,
                                         peer_buffer_addresses, lengths, Read)

    def batch_transfer_async(self, target_hostname: str,
                             buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int],
                             lengths: Sequence[int], opcode: TransferOpcode,
                             transport_hint: str = "") -> int:
        """A batch id, or 0 if the batch could not be submitted."""
        return max(0, self._submit(target_hostname, buffers,
                                   peer_buffer_addresses, lengths, opcode))

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Waits for every batch: 0 if all completed, -1 if any failed or
        timed out. Each batch is freed either way."""
        if self._engine is None:
            return -1
        result = 0
        for batch in batch_ids:
            batch = _batch_id(batch)
            if batch is None:  # Such as a failed submission's -1.
                result = -1
                continue
            try:
                state = self._engine.wait(batch, -1)[0]
            except FerryError as e:
                log.warning("batch %d: %s", batch, e)
                state = _FAILED
            if state != _COMPLETED:
                log.warning("batch %d ended %s", batch,
                            _STATE_NAMES.get(state, state))
                result = -1
            self._free(batch)
        return result

    def transfer_submit_write(self, target_hostname: str, buffer: int,
                              peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """A batch id, or -1."""
        batch = self._submit(target_hostname, [buffer],
                             [peer_buffer_address], [length], Write)
        return batch if batch > 0 else -1

    def transfer_check_status(self, batch_id: int) -> int:
        """1 completed, 0 running, -1 failed, -2 timed out (Mooncake's);
        the batch is freed once it completed or failed."""
        batch_id = _batch_id(batch_id)
        if self._engine is None or batch_id is None:
            return -1
        try:
            state, _, code, message = self._engine.request_status(batch_id, 0)
        except FerryError as e:
            log.warning("batch %d: %s", batch_id, e)
            return -1
        if state == _COMPLETED:
            self._free(batch_id)
            return 1
        if state == _FAILED:
            log.warning("batch %d failed: %s", batch_id,
                        FerryError(code, message))
            self._free(batch_id)
            return -1
        if state == _TIMEOUT:
            return -2
        return 0

    # ---- the rest --------------------------------------------------------

    def get_notifies(self) -> List[TransferNotify]:
        if self._engine is None:
            return []
        return [TransferNotify(name, message.decode(errors="replace"), sender,
                               verified)
                for sender, name, message, _, verified in
                self._engine.notifications()]

    @staticmethod
    def get_local_topology(device_name: Optional[str] = None) -> str:
        """This host's RDMA NICs as Mooncake's priority matrix (JSON);
        "{}" where there is none."""
        try:
            return _ferry.local_topology(device_name or "")
        except FerryError as e:
            log.warning("get_local_topology: %s", e)
            return "{}"

    def send_probe(self, peer_server_name: str) -> int:
        """0 if the peer's segment can be opened (its engine is there)."""
        if self._engine is None:
            return -1
        try:
            self._engine.refresh_segment(self._segment(peer_server_name))
        except FerryError as e:
            log.warning("probe of %r failed: %s", peer_server_name, e)
            # Opened again on the next transfer (the peer may come back).
            with self._lock:
                self._segments.pop(self._name(peer_server_name), None)
            return -1
        return 0

    # ---- handles -------------------------------------------------------

    def get_engine(self) -> Optional["_ferry.Engine"]:
        """The engine underneath (Mooncake returns its C++ engine, for its
        other modules): here ferry's extension object, or None before
        initialize."""
        return self._engine

    def get_engine_ptr(self) -> int:
        """The address of the C API's ferry_engine (include/ferry/ferry_c.h),
        for C code that calls Ferry on the same engine; 0 before
        initialize."""
        return 0 if self._engine is None else self._engine.handle()

    def warmup_efa_segment(self, segment_name: str) -> int:
        """Mooncake's EFA warm-up: opens the segment and reaches its engine
        ahead of the first transfer (Ferry connects on first use anyway)."""
        return self.send_probe(segment_name)

    # ---- transfers ordered on a CUDA stream -------------------------------
    #
    # As Mooncake's: the transfer starts once the stream's earlier work
    # (the kernels that wrote the KV cache) is done, and the stream's later
    # work waits for it; the call returns at once, and raises RuntimeError
    # if the transfer could not be queued. A transfer that fails cannot
    # fail the stream. Mooncake ends the process then (_exit(1)); Ferry
    # logs it and raises RuntimeError, naming it, from the next *_on_cuda
    # call (after queueing that call's transfer, which the message says)
    # or from cuda_transfer_error() -- call that after synchronising the
    # stream to know the bytes are there.

    def batch_transfer_on_cuda(self, target_hostname: str,
                               buffers: Sequence[int],
                               peer_buffer_addresses: Sequence[int],
                               lengths: Sequence[int],
                               opcode: TransferOpcode, stream_ptr: int = 0,
                               transport_hint: str = "") -> None:
        if self._engine is None:
            raise RuntimeError("the engine is not initialized")
        if not (len(buffers) == len(peer_buffer_addresses) == len(lengths)):
            raise RuntimeError("buffers, peer_buffer_addresses and lengths "
                               "differ in length")
        try:
            self._engine.submit_on_stream(int(opcode),
                                          self._segment(target_hostname),
                                          buffers, peer_buffer_addresses,
                                          lengths, int(stream_ptr or 0))
        except FerryError as e:
            raise RuntimeError(str(e)) from e
        # This one is queued; an earlier one's failure is still news.
        try:
            self._engine.stream_error()
        except FerryError as e:
            raise RuntimeError(
                f"an earlier *_on_cuda transfer failed (this call's was "
                f"queued): {e}") from e

    def batch_transfer_write_on_cuda(self, target_hostname: str,
                                     buffers: Sequence[int],
                                     peer_buffer_addresses: Sequence[int],
                                     lengths: Sequence[int],
                                     stream_ptr: int = 0,
                                     transport_hint: str = "") -> None:
        self.batch_transfer_on_cuda(target_hostname, buffers,
                                    peer_buffer_addresses, lengths, Write,
                                    stream_ptr)

    def batch_transfer_read_on_cuda(self, target_hostname: str,
                                    buffers: Sequence[int],
                                    peer_buffer_addresses: Sequence[int],
                                    lengths: Sequence[int],
                                    stream_ptr: int = 0,
                                    transport_hint: str = "") -> None:
        self.batch_transfer_on_cuda(target_hostname, buffers,
                                    peer_buffer_addresses, lengths, Read,
                                    stream_ptr)

    def transfer_write_on_cuda(self, target_hostname: str, buffer: int,
                               peer_buffer_address: int, length: int,
                               stream_ptr: int = 0,
                               transport_hint: str = "") -> None:
        self.batch_transfer_on_cuda(target_hostname, [buffer],
                                    [peer_buffer_address], [length], Write,
                                    stream_ptr)

    def transfer_read_on_cuda(self, target_hostname: str, buffer: int,
                              peer_buffer_address: int, length: int,
                              stream_ptr: int = 0,
                              transport_hint: str = "") -> None:
        self.batch_transfer_on_cuda(target_hostname, [buffer],
                                    [peer_buffer_address], [length], Read,
                                    stream_ptr)

    def cuda_transfer_error(self) -> None:
        """Ferry's addition: raises RuntimeError naming the first *_on_cuda
        transfer that failed since the last check (and how many did)."""
        if self._engine is None:
            return
        try:
            self._engine.stream_error()
        except FerryError as e:
            raise RuntimeError(str(e)) from e

    # ---- internals -------------------------------------------------------

    def _call(self, fn) -> int:
        if self._engine is None:
            log.warning("the engine is not initialized")
            return -1
        try:
            fn(self._engine)
        except FerryError as e:
            log.warning("%s", e)
            return -1
        return 0

    def _segment(self, name: str) -> int:
        name = self._name(name)
        with self._lock:
            handle = self._segments.get(name)
        if handle is None:
            handle = self._engine.open_segment(name)
            with self._lock:
                self._segments[name] = handle
        return handle

    def _name(self, name: str) -> str:
        # Session ids are P2P's: other modes' segment names are kept.
        return _session(name) if self._p2p else name

    def _submit(self, target: str, buffers: Sequence[int],
                peers: Sequence[int], lengths: Sequence[int],
                opcode: TransferOpcode) -> int:
        if self._engine is None or not (len(buffers) == len(peers) ==
                                        len(lengths)) or len(buffers) == 0:
            log.warning("transfer to %r refused: %s", target,
                        "the engine is not initialized" if self._engine is None
                        else "buffers, peer addresses and lengths must be "
                        "non-empty lists of one length")
            return -1
        try:
            return self._engine.submit_same(int(opcode), self._segment(target),
                                            buffers, peers, lengths)
        except FerryError as e:
            log.warning("transfer to %r failed: %s", target, e)
            return -1

    def _free(self, batch: int) -> None:
        try:
            self._engine.free_batch(batch)
        except FerryError:
            pass
