"""Ferry's exception: every failure carries a status code and a message."""

# Status codes (absl's and gRPC's numbers), as ferry_c.h names them.
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15
UNAUTHENTICATED = 16

_NAMES = {v: k for k, v in dict(globals()).items() if k.isupper()}


class FerryError(Exception):
    """A failed Ferry call: `code` (the constants above) and `message`."""

    def __init__(self, code: int, message: str):
        super().__init__(code, message)
        self.code = code
        self.message = message

    @property
    def code_name(self) -> str:
        return _NAMES.get(self.code, str(self.code))

    def __str__(self) -> str:
        return f"{self.code_name}: {self.message}"
