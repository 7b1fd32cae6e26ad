"""Failure traces, the trace-driven job simulator and baseline models."""
