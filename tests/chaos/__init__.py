"""Chaos (reliability) suite: real replica processes, real Redis faults, journals and checks.

See ``docs/reliability.md`` for the fault matrix, the guarantees and the measured bounds.
"""
