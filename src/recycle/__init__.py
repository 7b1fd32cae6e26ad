"""recycle: resilient data x pipeline parallel training by pipeline adaptation (ReCycle, SOSP'24)."""

__version__ = "0.1.0"
