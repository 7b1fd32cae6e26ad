"""Profile steady-state training steps in every worker of either side of bench_runtime_vs_pipelining.py.

Put this folder first on PYTHONPATH and set RECYCLE_STEP_PROFILE=DIR: every process that builds our TrainingOptimizer
(both sides of the benchmark use it) profiles its main thread from the end of its optimizer step number START to the
end of step START + N (RECYCLE_STEP_PROFILE_START, default 3; RECYCLE_STEP_PROFILE_STEPS, default 10), and writes
DIR/{ours|theirs}-{parameters}-{pid}.prof (cProfile with thread CPU time), or with RECYCLE_STEP_PROFILE_KIND=torch
DIR/...-{pid}.ops.tsv (torch.profiler: every aten op and autograd node, its count and self CPU time), or with
RECYCLE_STEP_PROFILE_KIND=threads DIR/...-{pid}.threads.tsv (every thread of the process: its user and system CPU over
those steps from /proc, and the process's page faults and context switches from getrusage). The side is told by the
caller of the step (our executor's optimizer_step, else theirs). Compare with compare.py here.
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

    class _Threads:
        """Every thread's user and system CPU (/proc/self/task) and the process's getrusage counts, between two
        points: a "profile" of the whole process, main thread, gloo's and the runtime's own threads alike."""

        _USAGE = ("ru_minflt", "ru_majflt", "ru_nvcsw", "ru_nivcsw")

        def __init__(self) -> None:
            import gc

            self.start = self._sample()
            self.collections = [0, 0, 0]  # the cyclic garbage collector's runs per generation, and their CPU
            self.gc_ms = [0.0, 0.0, 0.0]
            self._gc_started = 0.0
            gc.callbacks.append(self._on_gc)

        def _on_gc(self, phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                self._gc_started = time.thread_time()
            else:
                self.collections[info["generation"]] += 1
                self.gc_ms[info["generation"]] += (time.thread_time() - self._gc_started) * 1e3

        @staticmethod
        def _sample() -> tuple[dict[int, tuple[str, int, int]], tuple[int, ...]]:
            import resource

            threads = {}
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/stat") as stat:
                        text = stat.read()
                except FileNotFoundError:  # the thread ended meanwhile
                    continue
                fields = text[text.rindex(")") + 2:].split()
                threads[int(tid)] = (text[text.index("(") + 1:text.rindex(")")], int(fields[11]), int(fields[12]))
            usage = resource.getrusage(resource.RUSAGE_SELF)
            return threads, tuple(getattr(usage, name) for name in _Threads._USAGE)

        def write(self, path: str) -> None:
            """One line per thread (its Python name where it has one): name, user ms, system ms; then the counts."""
            import gc
            import threading

            gc.callbacks.remove(self._on_gc)
            (before, usage0), (after, usage1) = self.start, self._sample()
            names = {t.native_id: t.name for t in threading.enumerate()}
            tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
            with open(path, "w") as out:
                for tid, (comm, user, system) in sorted(after.items()):
                    _, user0, system0 = before.get(tid, (comm, 0, 0))
                    name = "main" if tid == os.getpid() else names.get(tid, f"native {comm}")
                    out.write(f"thread {name}\t{(user - user0) * tick_ms}\t{(system - system0) * tick_ms}\n")
                for name, a, b in zip(self._USAGE, usage0, usage1):
                    out.write(f"{name}\t{b - a}\t0\n")
                for generation, (count, ms) in enumerate(zip(self.collections, self.gc_ms)):
                    out.write(f"gc generation {generation} (runs, CPU ms)\t{count}\t{ms}\n")

    def _profiled_step(self: Any) -> None:
        side = "ours" if sys._getframe(1).f_code.co_name == "optimizer_step" else "theirs"
        _step(self)
        _seen["steps"] += 1
        if _seen["steps"] == _START:
            if _KIND == "torch":
                import torch.profiler

                profile: Any = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profile.__enter__()
            elif _KIND == "threads":
                profile = _Threads()
            else:
                profile = cProfile.Profile(time.thread_time)
                profile.enable()
            _seen["profile"] = profile
        elif _seen["steps"] == _START + _STEPS and _seen["profile"] is not None:
            profile, _seen["profile"] = _seen["profile"], None
            name = os.path.join(str(_DIR), f"{side}-{len(self.optimizer.param_groups[0]['params'])}-{os.getpid()}")
            if _KIND == "threads":
                profile.write(name + ".threads.tsv")
            elif _KIND == "torch":
                profile.__exit__(None, None, None)
                with open(name + ".ops.tsv", "w") as out:
                    out.writelines(f"{e.key}\t{e.count}\t{e.self_cpu_time_total}\n" for e in profile.key_averages())
            else:
                profile.disable()
                profile.dump_stats(name + ".prof")

    _optim.TrainingOptimizer.step = _profiled_step  # type: ignore[method-assign]
