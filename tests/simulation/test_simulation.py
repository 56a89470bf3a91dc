"""Invariants of the cluster under seeded fault schedules (see ``sim.py``), found by Hypothesis.

A failure shrinks to a minimal schedule, printed with the first violations and as a
``Scenario`` literal; replay it by passing that ``Scenario`` to ``sim.run_scenario``
(``test_known_schedules.py`` does that for the schedules found so far), or with the printed
``@reproduce_failure`` blob. The default profile is derandomized, so that CI plays the same
schedules on every run; ``HYPOTHESIS_PROFILE=simulate`` (``nox -s simulate``) plays many more,
from a random seed (``--hypothesis-seed=N`` repeats one).
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .sim import (
    LEADER,
    Fault,
    FaultKind,
    JobConfig,
    NodeConfig,
    Report,
    Scenario,
    Violation,
    play,
    run_scenario,
)

SIMULATE = os.environ.get("HYPOTHESIS_PROFILE") == "simulate"
# A timeout marker overrides --timeout on the command line: none for the long runs.
pytestmark = [pytest.mark.simulation, pytest.mark.timeout(0 if SIMULATE else 300)]
settings.register_profile(
    "sim-ci",
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "simulate", settings.get_profile("sim-ci"), max_examples=4_000, derandomize=False
)
PROFILE = settings.get_profile("simulate" if SIMULATE else "sim-ci")
HORIZON_S = 5.0 if SIMULATE else 2.5
"""Faults come within the first seconds of a schedule; each schedule then runs quiet. The
default profile keeps schedules short and clusters small: a node costs ~2 ms of CPU per
simulated second (its election rounds and timers), and CI plays as many schedules as fit."""
MAX_NODES = 4 if SIMULATE else 3

STORE_FAULTS: tuple[FaultKind, ...] = (
    "slow_reply", "lost_reply", "lost_request", "restart", "delete", "foreign"
)  # fmt: skip
GRAY_FAULTS: tuple[FaultKind, ...] = ("silent", "claims_down", "lost_reply", "slow_reply")
"""Faults with no error: a flow gone silent, claims that never return while the election is
answered, a reply that never comes or comes late."""
NODE_FAULTS: tuple[FaultKind, ...] = (
    "wall_step", "pause", "suspend", "stop", "crash", "start", "schedule_fails"
)  # fmt: skip


class OverlapViolation(AssertionError):
    """(a) two nodes ran the job at once while the store kept its key."""


class TokenViolation(AssertionError):
    """(b) a term's fencing token was not above every earlier term's."""


class TickTwiceViolation(AssertionError):
    """(c) one tick instant ran twice."""


class LateLostViolation(AssertionError):
    """(d) leadership_lost (or a "cancel" run's end) came after the lease deadline."""


class LoopDiedViolation(AssertionError):
    """(e) an election loop, its helpers or the timer of a live node died, or a schedule."""


class StaleStartViolation(AssertionError):
    """(f) a job's code started without a valid lease."""


class LivenessViolation(AssertionError):
    """(g) a job ran nowhere for longer than the bound while a node was healthy."""


_ERRORS: dict[str, type[AssertionError]] = {
    "overlap": OverlapViolation,
    "token": TokenViolation,
    "tick_twice": TickTwiceViolation,
    "late_lost": LateLostViolation,
    "loop_died": LoopDiedViolation,
    "stale_start": StaleStartViolation,
    "liveness": LivenessViolation,
}


def check(scenario: Scenario) -> None:
    """Play ``scenario`` and raise for its first violation, one exception type per invariant
    so that Hypothesis shrinks (and reports) each kind of failure on its own."""
    violations: list[Violation] = run_scenario(scenario)
    if violations:
        raise _ERRORS[violations[0].invariant](str(Report(scenario, violations)))


def _thousandths(high: float, *, signed: bool = False) -> st.SearchStrategy[float]:
    """Uniform in ``[0, high]`` (``[-high, high]`` if ``signed``) in steps of a thousandth
    (ms for times), shrinking towards 0. Cheaper to draw than floats, a shrunk schedule reads
    in round numbers, and uniform: Hypothesis draws a wide range of integers biased to small
    values, which would crowd the faults into the first second."""
    span = round(high * 1000)
    parts = st.tuples(st.booleans(), st.integers(0, span // 100), st.integers(0, 99))

    def value(t: tuple[bool, int, int]) -> float:
        x = min(100 * t[1] + t[2], span) / 1000
        return -x if signed and t[0] else x

    return parts.map(value)


_nodes = st.builds(
    NodeConfig,
    wall_offset_s=_thousandths(0.1, signed=True),
    rate_error=st.integers(-500, 500).map(lambda ppm: ppm * 1e-6),  # within NTP's 500 ppm
)
_jobs = st.builds(
    JobConfig,
    kind=st.sampled_from(["fixed_rate", "interval", "cron"]),
    policy=st.sampled_from(["finish", "cancel"]),
)
_RANGES: dict[FaultKind, tuple[float, float]] = {
    "slow_reply": (0.0, 1.0),  # a fraction of the call timeout
    "restart": (0.0, 1.5),  # the server's downtime
    "foreign": (0.05, 3.0),  # the foreign value's TTL
    "wall_step": (-2.0, 2.0),
    "pause": (0.0, 2.0),
    "suspend": (0.0, 3.0),
    "silent": (0.0, 3.0),  # how long the flow stays silent
    "claims_down": (0.0, 3.0),  # how long the claims go unanswered
}
"""``Fault.value`` of the kinds that have one, from a fraction in [-1, 1]."""
PLACEMENTS: tuple[Literal["first", "spread"], ...] = ("first", "spread")
_FLAGS: dict[FaultKind, tuple[str, ...]] = {
    "restart": ("locks", "locks+fences", "all"),
    "foreign": ("", "garbage", "huge"),
}


def _fault(kind: FaultKind, at_s: float, node: int, x: float, flag: int, job: int) -> Fault:
    low, high = _RANGES.get(kind, (0.0, 0.0))
    value = round(x * high if low < 0 else low + abs(x) * (high - low), 6)
    flags = _FLAGS.get(kind, ("",))
    return Fault(at_s, kind, node, value, flags[flag % len(flags)], job)


@functools.cache  # built and validated once per kinds and node count, not per schedule
def _faults(kinds: tuple[FaultKind, ...], nodes: int) -> st.SearchStrategy[list[Fault]]:
    fault = st.builds(
        _fault,
        st.sampled_from(kinds),
        _thousandths(HORIZON_S),
        st.integers(LEADER, nodes - 1),
        _thousandths(1.0, signed=True),
        st.integers(0, 2),
        st.integers(0, 1),
    )
    return st.lists(fault, min_size=1, max_size=6)


@st.composite
def scenarios(draw: st.DrawFn, kinds: tuple[FaultKind, ...]) -> Scenario:
    nodes = tuple(draw(st.lists(_nodes, min_size=2, max_size=MAX_NODES)))
    jobs = tuple(draw(st.lists(_jobs, min_size=1, max_size=2)))
    faults = tuple(draw(_faults(kinds, len(nodes))))
    placement = draw(st.sampled_from(PLACEMENTS))
    return Scenario(nodes, jobs, faults, seed=draw(st.integers(0, 2**16)), placement=placement)


@settings(PROFILE)
@given(scenarios(STORE_FAULTS))
def test_store_faults(scenario: Scenario) -> None:
    """Slow and lost replies, lost requests, restarts that lose keys (and refuse calls for a
    while), an operator's DEL and foreign lock values."""
    check(scenario)


@settings(PROFILE)
@given(scenarios(NODE_FAULTS))
def test_node_faults(scenario: Scenario) -> None:
    """Clock skews and steps, pauses, suspends, graceful stops, crashes and restarts, and a
    node's schedule of a job that fails (it retires the job)."""
    check(scenario)


@settings(PROFILE)
@given(scenarios(GRAY_FAULTS))
def test_gray_faults(scenario: Scenario) -> None:
    """Gray failures: a node's flow to the store goes silent (no error, no reply), its claims
    go unanswered while its election is answered, replies lost or late. Invariant (g) holds
    the others to running every job meanwhile."""
    check(scenario)


@settings(PROFILE)
@given(scenarios(STORE_FAULTS + GRAY_FAULTS + NODE_FAULTS))
def test_all_faults(scenario: Scenario) -> None:
    """Every kind of fault, mixed."""
    check(scenario)


def test_replay_is_deterministic() -> None:
    """A schedule plays the same way every time: Hypothesis can shrink a failure, and a
    schedule written down replays it."""
    scenario = Scenario(
        (NodeConfig(0.03), NodeConfig(-0.02, 3e-4), NodeConfig()),
        (JobConfig("fixed_rate", "cancel"), JobConfig("cron", "finish")),
        (
            Fault(0.3, "slow_reply", value=0.5),
            Fault(1.1, "crash"),
            Fault(1.5, "start", node=0),
            Fault(1.7, "suspend", node=1, value=0.6),
            Fault(2.0, "stop", node=2),
            Fault(2.2, "restart", value=0.4, flag="locks"),
        ),
        seed=7,
    )

    def outcome() -> tuple[list[str], object, list[Violation]]:
        sim = play(scenario)
        return [str(run) for run in sim.runs], sim.terms, sim.violations

    first = outcome()
    assert len(first[0]) > 5, "the schedule should run the jobs"
    assert outcome() == first
