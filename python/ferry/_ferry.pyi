"""Type stub of ferry._ferry, the extension under the `ferry` package (a thin
layer over the C API, include/ferry/ferry_c.h). Errors raise
ferry.errors.FerryError(code, message); every call that may wait releases
the GIL."""

from typing import List, Sequence, Tuple

READ: int
WRITE: int

def buffer_address(obj: object) -> Tuple[int, int, bool]:
    """(address, size, read-only) of an object's buffer (buffer protocol).
    Keep a memoryview of the object while the address is in use."""

def local_topology(devices: str = ...) -> str:
    """This host's RDMA NICs as Mooncake's priority matrix (JSON);
    `devices` is a comma-separated filter. FerryError(NOT_FOUND) if none."""

class Engine:
    def __init__(self, options: Sequence[Tuple[str, str]]) -> None:
        """Starts an engine with EngineOptions' fields by name."""
    def close(self) -> None:
        """Shuts the engine down; idempotent."""
    def segment_name(self) -> str: ...
    def metadata_address(self) -> str: ...
    def rpc_address(self) -> str:
        """host:port of this engine's gRPC server."""
    def register(self, addr: int, length: int, location: str,
                 remote: bool) -> None: ...
    def unregister(self, addr: int) -> None: ...
    def register_batch(self, addrs: List[int], lengths: List[int],
                       location: str, remote: bool) -> None:
        """All or none, with one metadata round trip."""
    def unregister_batch(self, addrs: List[int]) -> None: ...
    def segment_buffers(self, segment: int) -> List[Tuple[int, int]]:
        """(address, length) of the segment's remote-accessible buffers."""
    def open_segment(self, name: str) -> int: ...
    def refresh_segment(self, segment: int) -> None:
        """Fetches the descriptor again (FerryError if the peer is gone)."""
    def close_segment(self, segment: int) -> None: ...
    def new_batch(self, capacity: int) -> int: ...
    def submit(self, batch: int,
               requests: List[Tuple[int, int, int, int, int]]) -> None:
        """(opcode, local address, segment, remote address, length) each;
        all or none."""
    def pin(self, addr: int, obj: object) -> None:
        """Keeps `obj` alive until unpin(addr) or until the engine is freed
        (after close, once no call on another thread uses it)."""
    def unpin(self, addr: int) -> object:
        """What pin kept at `addr` (None if nothing), no longer kept."""
    def submit_same(self, opcode: int, segment: int, buffers: Sequence[int],
                    peers: Sequence[int], lengths: Sequence[int]) -> int:
        """A new batch of one opcode to one segment, from three parallel
        sequences (all or none); its id."""
    def transfer_same(self, opcode: int, segment: int,
                      buffers: Sequence[int], peers: Sequence[int],
                      lengths: Sequence[int]) -> Tuple[int, int, int, int, int]:
        """submit_same, waiting until every request ended, and the batch
        freed, in one call; the final (state, total, completed, failed,
        bytes)."""
    def submit_on_stream(self, opcode: int, segment: int,
                         buffers: Sequence[int], peers: Sequence[int],
                         lengths: Sequence[int], stream: int) -> None:
        """Queues the requests on CUDA stream `stream` (a cudaStream_t as
        an int; 0: the legacy default stream): they run after its earlier
        work, and its later work waits for them. Raises if nothing was
        queued; their own failures are kept for stream_error()."""
    def stream_error(self) -> None:
        """Raises the first failure of a stream transfer since the last
        call (naming how many failed); returns if none failed."""
    def stats(self) -> str:
        """The engine's counters as JSON (ferry_engine_stats)."""
    def handle(self) -> int:
        """The address of its ferry_engine (the C API's handle)."""
    def wait(self, batch: int,
             timeout_ms: int) -> Tuple[int, int, int, int, int]:
        """(state, total, completed, failed, bytes); FerryError
        (DEADLINE_EXCEEDED) if the timeout passed first."""
    def request_status(self, batch: int,
                       index: int) -> Tuple[int, int, int, str]:
        """(state, bytes, error code, error message) of one request."""
    def free_batch(self, batch: int) -> None: ...
    def notify(self, segment: int, name: str, message: bytes) -> None: ...
    def notifications(
            self) -> List[Tuple[str, str, bytes, str, bool]]:
        """(from segment, name, message, sender address, verified) each."""
