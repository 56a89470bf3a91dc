"""Deterministic simulation of a cluster under seeded faults (see ``sim.py``)."""
