"""Around the runtime, not in its recovery path: fault injection (scripted and chaos), in-memory fakes, the profiler
and the single-process reference."""
