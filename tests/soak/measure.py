"""What the soak runs measured: one time per run of each scenario, or None for a run that did
not get there, and the distribution of those times for the summary and the docs."""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ENABLE_ENV", "REPORT_ENV", "RUNS_ENV", "Measurements", "enabled", "runs"]

ENABLE_ENV = "SJTEST_SOAK"
"""Set to 1 (``nox -s soak`` does) to run the soak; without it every soak test skips."""
RUNS_ENV = "SJTEST_SOAK_RUNS"
"""How many runs of each scenario, instead of its own number (a quick check: 3)."""
REPORT_ENV = "SJTEST_SOAK_REPORT"
"""A path: every measured run is written there as JSON at the end of the session."""


def enabled() -> bool:
    """Whether the soak runs (``SJTEST_SOAK=1``)."""
    return os.environ.get(ENABLE_ENV) == "1"


def runs(default: int) -> int:
    """How many runs a scenario makes: ``default``, or ``SJTEST_SOAK_RUNS``; one (which
    skips) when the soak is not enabled, so that the default suite lists it once."""
    if not enabled():
        return 1
    return int(os.environ.get(RUNS_ENV, default))


@dataclass
class Scenario:
    """The runs of one scenario: a time each (None: not within ``limit_s``)."""

    bound_s: float
    """What each run must stay within (the test asserts it)."""
    limit_s: float
    """How long a run waits before it gives up measuring."""
    times_s: dict[int, float | None] = field(default_factory=dict)

    def summary(self) -> str:
        """``n runs: min, median, p90, max; k over the bound, j never within the limit``."""
        done = sorted(t for t in self.times_s.values() if t is not None)
        never = len(self.times_s) - len(done)
        over = sum(t > self.bound_s for t in done) + never
        spread = "no run got there"
        if done:
            p90 = done[math.ceil(0.9 * len(done)) - 1]  # nearest rank
            spread = (
                f"min {done[0]:.2f} s, median {statistics.median(done):.2f} s, "
                f"p90 {p90:.2f} s, max {done[-1]:.2f} s"
            )
        return (
            f"{len(self.times_s)} runs: {spread}; {over} not within the bound of "
            f"{self.bound_s:g} s ({never} not within {self.limit_s:g} s)"
        )


class Measurements:
    """Every soak scenario of the session, by name."""

    def __init__(self) -> None:
        self.scenarios: dict[str, Scenario] = {}

    def add(
        self, scenario: str, run: int, time_s: float | None, *, bound_s: float, limit_s: float
    ) -> None:
        """Record the time of one run of ``scenario`` (None: not within ``limit_s``)."""
        entry = self.scenarios.setdefault(scenario, Scenario(bound_s, limit_s))
        entry.times_s[run] = time_s
        shown = "never" if time_s is None else f"{time_s:.3f} s"
        print(f"[soak {scenario}] run {run}: {shown}")

    def lines(self) -> list[str]:
        """One line per scenario, for the terminal summary."""
        return [f"{name}: {entry.summary()}" for name, entry in self.scenarios.items()]

    def dump(self, path: Path) -> None:
        """Write every run's time, and each scenario's bounds, as JSON."""
        data = {
            name: {"bound_s": e.bound_s, "limit_s": e.limit_s, "times_s": e.times_s}
            for name, e in self.scenarios.items()
        }
        path.write_text(json.dumps(data, indent=1))
