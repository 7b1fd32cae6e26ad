"""Profile steady-state training steps in every worker of either side of bench_runtime_vs_pipelining.py.

Put this folder first on PYTHONPATH and set RECYCLE_STEP_PROFILE=DIR: every process that builds our TrainingOptimizer
(both sides of the benchmark use it) profiles its main thread from the end of its optimizer step number START to the
end of step START + N (RECYCLE_STEP_PROFILE_START, default 3; RECYCLE_STEP_PROFILE_STEPS, default 10), and writes
DIR/{ours|theirs}-{parameters}-{pid}.prof (cProfile with thread CPU time), or with RECYCLE_STEP_PROFILE_KIND=torch
DIR/...-{pid}.ops.tsv (torch.profiler: every aten op and autograd node, its count and self CPU time). The side is
told by the caller of the step (our executor's optimizer_step, else theirs). Compare with compare.py here.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

_DIR = os.environ.get("RECYCLE_STEP_PROFILE")
if _DIR:
    import cProfile

    from recycle.runtime.state import optim as _optim

    _START = int(os.environ.get("RECYCLE_STEP_PROFILE_START", "3"))
    _STEPS = int(os.environ.get("RECYCLE_STEP_PROFILE_STEPS", "10"))
    _KIND = os.environ.get("RECYCLE_STEP_PROFILE_KIND", "cprofile")
    _step = _optim.TrainingOptimizer.step
    _seen: dict[str, Any] = {"steps": 0, "profile": None}

    def _profiled_step(self: Any) -> None:
        side = "ours" if sys._getframe(1).f_code.co_name == "optimizer_step" else "theirs"
        _step(self)
        _seen["steps"] += 1
        if _seen["steps"] == _START:
            if _KIND == "torch":
                import torch.profiler

                profile: Any = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profile.__enter__()
            else:
                profile = cProfile.Profile(time.thread_time)
                profile.enable()
            _seen["profile"] = profile
        elif _seen["steps"] == _START + _STEPS and _seen["profile"] is not None:
            profile, _seen["profile"] = _seen["profile"], None
            name = os.path.join(str(_DIR), f"{side}-{len(self.optimizer.param_groups[0]['params'])}-{os.getpid()}")
            if _KIND == "torch":
                profile.__exit__(None, None, None)
                with open(name + ".ops.tsv", "w") as out:
                    out.writelines(f"{e.key}\t{e.count}\t{e.self_cpu_time_total}\n" for e in profile.key_averages())
            else:
                profile.disable()
                profile.dump_stats(name + ".prof")

    _optim.TrainingOptimizer.step = _profiled_step  # type: ignore[method-assign]
