"""The library's version: the one place it is written (``pyproject.toml`` reads it from here, and
``__version__``, the telemetry's instrumentation scope and each node's membership record say it)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
