"""How a launcher's worker processes start: the multiprocessing context, and a forkserver started early."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver
from typing import Any

from recycle.runtime.options import StartMethod

__all__ = ["FORKSERVER_PRELOAD", "start_context", "warm_start"]

# torch._dynamo: every worker's first optimizer step imports it (~0.5 s of CPU each, measured with AdamW);
# torch.distributed.tensor.parallel: every tensor-parallel worker's first step (~0.5 s more); once here.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor.parallel",
                      "recycle.runtime.worker.process"]


def start_context(start_method: StartMethod) -> Any:
    """The multiprocessing context the workers start from (typeshed's BaseContext lacks Process: hence Any)."""
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


def warm_start(start_method: StartMethod) -> None:
    """Start the forkserver now, before the launcher imports torch itself: the server's imports (torch and the
    worker's modules, ~4 s of CPU here) then run beside the launcher's instead of after them, when its first worker
    starts. The launcher changes no environment variable in between, so the workers see the same one. A no-op for
    spawn, or when the server already runs (a second launch in one process)."""
    if start_method == "forkserver":
        start_context(start_method)
        forkserver.ensure_running()
