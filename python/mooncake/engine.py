"""`mooncake.engine` on Ferry: the names Mooncake's binding exports that
its clients import, from ferry.mooncake."""

from ferry.mooncake import (SUPPORT_CUDA, Read, TransferEngine,  # noqa: F401
                            TransferNotify, TransferOpcode, Write)

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "Read",
           "Write", "SUPPORT_CUDA"]
