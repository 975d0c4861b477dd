"""Ferry: a transfer engine for KV-cache migration and multi-node transfers.

The pythonic layer over Ferry's engine::

    import ferry
    with ferry.Engine(local_segment_name="decode-0") as engine:
        kv = bytearray(1 << 20)
        addr = engine.register(kv)           # zero-copy, pinned while registered
        peer = engine.open_segment("prefill-0")
        batch = engine.batch([ferry.Request.read(addr, peer, remote_addr,
                                                 len(kv))])
        batch.wait(timeout=10)

Options are EngineOptions' fields by name (ferry_c.h lists them); values
may be str, int, bool or a list of str. Errors raise FerryError(code,
message). Every call that waits releases the GIL; an Engine may be used from
several threads.
"""

from __future__ import annotations

# The wheel's version (devtools/wheel.sh reads it here).
__version__ = "0.4.0"

import json
import math
import operator
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ferry.errors import FerryError  # noqa: F401  (re-exported)
from ferry import errors


def _prefer_the_hosts_verbs() -> None:
    """The wheel (devtools/wheel.sh) bundles rdma-core's libibverbs in
    ferry/.libs, for hosts without it. A host that has its own, whose
    providers drive its NICs, gets that one: loaded first, it is the
    libibverbs.so.1 the extension then uses."""
    import ctypes
    import os
    if os.path.isdir(os.path.join(os.path.dirname(__file__), ".libs")):
        try:
            ctypes.CDLL("libibverbs.so.1", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass  # None here: the bundled one.


_prefer_the_hosts_verbs()
from ferry import _ferry  # noqa: E402  (after the line above)
from ferry import _memory

__all__ = ["Engine", "Batch", "Request", "Notification", "FerryError", "errors"]

READ = _ferry.READ
WRITE = _ferry.WRITE

# Transfer states, as ferry_c.h numbers them.
WAITING, PENDING, COMPLETED, FAILED, TIMEOUT = range(5)
STATE_NAMES = ("WAITING", "PENDING", "COMPLETED", "FAILED", "TIMEOUT")


def _option(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def _flatten(options: Dict[str, Any],
             prefix: str = "") -> List[Tuple[str, str]]:
    """Options as the C API's (name, value) pairs: a dict value is a nested
    struct (tcp={"port": 5000} is "tcp.port")."""
    out: List[Tuple[str, str]] = []
    for key, value in options.items():
        if isinstance(value, dict):
            out.extend(_flatten(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", _option(value)))
    return out


@dataclass(frozen=True)
class Request:
    """One transfer: `length` bytes between local memory and a segment."""

    opcode: int
    local_addr: int
    segment: int
    remote_addr: int
    length: int

    @staticmethod
    def read(local_addr: int, segment: int, remote_addr: int,
             length: int) -> "Request":
        return Request(READ, local_addr, segment, remote_addr, length)

    @staticmethod
    def write(local_addr: int, segment: int, remote_addr: int,
              length: int) -> "Request":
        return Request(WRITE, local_addr, segment, remote_addr, length)


@dataclass(frozen=True)
class Notification:
    from_segment: str  # As the sender claims it; trust it if sender_verified.
    name: str
    message: bytes
    sender_address: str  # As the connection shows it.
    sender_verified: bool


class Batch:
    """Requests submitted together; wait() for them, then status()."""

    def __init__(self, engine: "Engine", batch_id: int, count: int):
        self._engine = engine
        self._id = batch_id
        self._count = count
        self._freed = False

    @property
    def id(self) -> int:
        return self._id

    def wait(self, timeout: Optional[float] = None) -> Tuple[int, int]:
        """Waits until every request is done: (state, bytes moved).

        Raises FerryError(DEADLINE_EXCEEDED) if `timeout` (seconds; None:
        no limit) passes first; the requests go on.
        """
        ms = (-1 if timeout is None or timeout == math.inf else
              max(0, int(timeout * 1000)))
        state, _, _, _, moved = self._engine._raw().wait(self._id, ms)
        return state, moved

    def status(self, index: int) -> Tuple[int, int, Optional[FerryError]]:
        """Request `index`: (state, bytes moved, its error or None)."""
        state, moved, code, message = self._engine._raw().request_status(
            self._id, index)
        return state, moved, (FerryError(code, message) if code else None)

    def free(self) -> None:
        if not self._freed:
            self._engine._raw().free_batch(self._id)
            self._freed = True


class Engine:
    """A Ferry engine: a context manager that shuts down on exit."""

    def __init__(self, **options: Any):
        self._lock = threading.Lock()
        # What is registered is pinned in the extension's engine (a
        # memoryview keeps the object alive and not resizable) until it is
        # unregistered or the engine is freed. Read-only registrations (address -> length): never READ into.
        self._readonly: Dict[int, int] = {}
        self._engine = _ferry.Engine(_flatten(options))

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_engine"):
            self.close()

    def close(self) -> None:
        """Closes the engine: later calls raise. It shuts down (requests in
        flight end FAILED) at once, or, while calls on other threads still
        use it, when the last of them returns; only then are registered
        objects released, since peers may WRITE into them until then."""
        self._engine.close()
        with self._lock:
            self._readonly.clear()

    def _raw(self) -> Any:
        return self._engine

    @property
    def segment_name(self) -> str:
        return self._engine.segment_name()

    @property
    def metadata_address(self) -> str:
        return self._engine.metadata_address()

    def register(self, buffer: Any, location: Optional[str] = None,
                 remote_accessible: bool = True) -> int:
        """Registers the memory an object holds, zero-copy; returns its
        address.

        `buffer` is a torch tensor (CPU or CUDA), an object with
        ``__cuda_array_interface__`` (CuPy, Numba) or ``__dlpack__``, or a
        host buffer (bytearray, numpy array, mmap: the buffer protocol).
        The device comes from the object; `location` overrides it ("cpu:N",
        "cuda:N" or "*": the engine asks the CUDA driver). The object is
        kept alive until unregister(); a host buffer cannot be resized
        meanwhile. Only C-contiguous objects are accepted.
        """
        mem = _memory.describe(buffer)
        if mem is not None:
            if mem.readonly and remote_accessible:
                raise FerryError(
                    errors.INVALID_ARGUMENT,
                    "a read-only array cannot be remote-accessible (peers "
                    "may WRITE it); pass remote_accessible=False")
            self._engine.register(mem.addr, mem.length, location or
                                  mem.location, remote_accessible)
            try:
                self._engine.pin(mem.addr, buffer)
            except BaseException:
                self._engine.unregister(mem.addr)
                raise
            if mem.readonly:
                with self._lock:
                    self._readonly[mem.addr] = mem.length
            return mem.addr
        view = memoryview(buffer)
        addr, length, readonly = _ferry.buffer_address(view)
        if readonly and remote_accessible:
            view.release()
            raise FerryError(
                errors.INVALID_ARGUMENT,
                "a read-only buffer cannot be remote-accessible (peers may "
                "WRITE it); pass remote_accessible=False to send from it")
        try:
            self._engine.register(addr, length, location or "cpu:0",
                                  remote_accessible)
        except BaseException:
            view.release()
            raise
        self._engine.pin(addr, view)
        if readonly:
            with self._lock:
                self._readonly[addr] = length
        return addr

    def register_address(self, addr: int, length: int,
                         location: str = "cpu:0",
                         remote_accessible: bool = True) -> None:
        """Registers raw memory the caller keeps alive."""
        self._engine.register(addr, length, location, remote_accessible)

    def unregister(self, buffer_or_addr: Any) -> None:
        try:
            addr = operator.index(buffer_or_addr)  # An int, numpy's too.
        except TypeError:
            mem = _memory.describe(buffer_or_addr)
            addr = (mem.addr if mem is not None else
                    _ferry.buffer_address(buffer_or_addr)[0])
        self._engine.unregister(addr)
        with self._lock:
            self._readonly.pop(addr, None)
        view = self._engine.unpin(addr)
        if isinstance(view, memoryview):
            view.release()

    def open_segment(self, name: str) -> int:
        return self._engine.open_segment(name)

    def close_segment(self, segment: int) -> None:
        self._engine.close_segment(segment)

    def batch(self, requests: Sequence[Request],
              capacity: Optional[int] = None) -> Batch:
        """Allocates a batch and submits `requests` to it (all or none)."""
        with self._lock:
            readonly = list(self._readonly.items())
        for i, r in enumerate(requests):
            if r.opcode == READ and any(a <= r.local_addr < a + n
                                        for a, n in readonly):
                raise FerryError(
                    errors.INVALID_ARGUMENT,
                    f"request {i}: a READ into a read-only buffer "
                    f"(0x{r.local_addr:x})")
        batch_id = self._engine.new_batch(capacity or max(1, len(requests)))
        try:
            self._engine.submit(batch_id, [
                (r.opcode, r.local_addr, r.segment, r.remote_addr, r.length)
                for r in requests
            ])
        except BaseException:  # FerryError, or a value pybind11 refused.
            self._engine.free_batch(batch_id)
            raise
        return Batch(self, batch_id, len(requests))

    def notify(self, segment: int, name: str, message: bytes) -> None:
        self._engine.notify(segment, name, bytes(message))

    def stats(self) -> Dict[str, Any]:
        """The engine's counters, as C++'s GetEngineStats and
        GetTransportStats give them: EngineStats's fields, and
        "transports", a list of each transport's fields with its "nics"."""
        return json.loads(self._raw().stats())

    def notifications(self) -> List[Notification]:
        return [Notification(*n) for n in self._engine.notifications()]


def address_of(buffer: Any) -> int:
    """The address of the memory an object holds (a tensor, an array with
    the CUDA array interface or DLPack, or a host buffer)."""
    mem = _memory.describe(buffer)
    if mem is not None:
        return mem.addr
    return _ferry.buffer_address(memoryview(buffer))[0]
