"""Ferry's stand-in for Mooncake (`tools/dev.sh python --as-mooncake`).

`from mooncake.engine import TransferEngine` gets ferry.mooncake's
TransferEngine, so that clients written for Mooncake (SGLang's and vLLM's
connectors) run on Ferry unchanged. Only the transfer engine is here:
Mooncake Store is not.
"""

# The installer tells its own package from a real Mooncake by this.
FERRY_SHIM = True
