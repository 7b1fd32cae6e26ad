"""What the fast AdamW saves per worker process: the time to build the default optimizer and its LR schedule in a
fresh process (after `import torch`), recycle's fast path vs `torch.optim.AdamW`, whose first construction imports
torch._dynamo. Side by side, alternating, in fresh processes.

Run: .venv/bin/python benchmarks/bench_optimizer_startup.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CODE = """
import sys, time, torch
from recycle.config import Training
from recycle.runtime.state.optim import TrainingOptimizer
model = torch.nn.Linear(8, 8)
training = Training(lr_schedule="cosine", warmup_steps=2, steps=10, amsgrad={amsgrad})
t0 = time.perf_counter()
optimizer = TrainingOptimizer(list(model.parameters()), training)
model(torch.ones(1, 8)).sum().backward()
optimizer.step()
print(time.perf_counter() - t0, optimizer.fast, "torch._dynamo" in sys.modules)
"""


def measure(amsgrad: bool) -> tuple[float, bool, bool]:
    # amsgrad=False is the default AdamW (the fast path); amsgrad=True is torch.optim.AdamW, whose construction is
    # the same for amsgrad on or off (the flag only changes the step).
    out = subprocess.run([sys.executable, "-c", CODE.format(amsgrad=amsgrad)], capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    return float(out[0]), out[1] == "True", out[2] == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    fast, torch_optim = [], []
    for _ in range(args.repeats):
        seconds, is_fast, dynamo = measure(False)
        assert is_fast and not dynamo
        fast.append(seconds)
        seconds, is_fast, dynamo = measure(True)
        assert not is_fast and dynamo
        torch_optim.append(seconds)
    f, t = statistics.median(fast), statistics.median(torch_optim)
    print(f"build + first step of AdamW with a warm-up + cosine LambdaLR, fresh process, median of {args.repeats}:")
    print(f"  recycle fast path (torch._dynamo not imported): {f * 1e3:8.1f} ms")
    print(f"  torch.optim.AdamW (imports torch._dynamo):      {t * 1e3:8.1f} ms")
    print(f"  the fast path saves {t - f:.2f} s per worker process ({t / f:.0f}x)")


if __name__ == "__main__":
    main()
