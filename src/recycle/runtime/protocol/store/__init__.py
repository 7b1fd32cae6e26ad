"""The job's store: an authenticated key-value server (only processes that hold the job token get in, and the
coordinator can fence any of them) and its clients; `torch.distributed` process groups rendezvous through it too."""

from recycle.runtime.protocol.store.client import (LocalStore, StoreAuthError, StoreClient, StoreFenced,
                                                   StoreInterrupted, StoreUnavailable)
from recycle.runtime.protocol.store.server import StoreLimits, StoreServer

__all__ = ["StoreServer", "StoreLimits", "StoreClient", "LocalStore", "StoreFenced", "StoreAuthError",
           "StoreUnavailable", "StoreInterrupted"]
