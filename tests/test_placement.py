"""Placement (``placement="spread"``): rendezvous ranking, stable under churn, pure logic."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from datetime import UTC, datetime

import pytest

from fastapi_singletonjob._election.lease import Lease
from fastapi_singletonjob._election.placement import Candidate, Placement, Spreader, rank
from fastapi_singletonjob._store.membership import MemberRecord, Membership, jobs_digest
from fastapi_singletonjob.testing import FakeClock

JOBS = [f"job-{i}" for i in range(200)]


def nodes(*ids: str, jobs: list[str] = JOBS, settled: bool = True) -> list[Candidate]:
    return [Candidate(node, frozenset(jobs), settled) for node in ids]


def preferred(candidates: list[Candidate], jobs: list[str] = JOBS) -> dict[str, str | None]:
    placement = Placement("observer")
    placement.update(candidates, jobs)
    return {job: placement.preferred(job) for job in jobs}


def test_rank_is_the_same_whatever_the_order_given() -> None:
    ids = [f"web-{i}" for i in range(10)]
    assert rank("export", ids) == rank("export", list(reversed(ids)))
    assert sorted(rank("export", ids)) == sorted(ids)
    assert rank("export", ids) != rank("report", ids)  # each job has its own order


@pytest.mark.parametrize("replicas", [3, 10, 50])
def test_leadership_spreads_over_the_replicas(replicas: int) -> None:
    ids = [f"web-{i}" for i in range(replicas)]
    counts = Counter(preferred(nodes(*ids)).values())
    mean = len(JOBS) / replicas
    print(
        f"{replicas} replicas x {len(JOBS)} jobs: min {min(counts.values())}, max "
        f"{max(counts.values())}, stdev {statistics.pstdev(counts.values()):.1f} (mean {mean:g})"
    )
    if mean >= 10:  # with a few jobs per replica, hashing leaves some without any
        assert set(counts) == set(ids)
    assert max(counts.values()) <= 2.5 * mean


def test_twelve_jobs_over_three_replicas_settle_to_four_plus_or_minus_two() -> None:
    jobs = [f"job-{i}" for i in range(12)]
    counts = Counter(preferred(nodes("web-a", "web-b", "web-c", jobs=jobs), jobs).values())
    assert all(2 <= counts[node] <= 6 for node in ("web-a", "web-b", "web-c")), counts


def test_a_join_moves_only_jobs_to_the_new_node_about_its_share() -> None:
    before = preferred(nodes("a", "b", "c"))
    after = preferred(nodes("a", "b", "c", "d"))
    moved = [job for job in JOBS if before[job] != after[job]]
    assert all(after[job] == "d" for job in moved)
    assert 0.1 * len(JOBS) <= len(moved) <= 0.4 * len(JOBS)  # about a quarter


def test_a_leave_moves_only_the_leavers_jobs() -> None:
    before = preferred(nodes("a", "b", "c", "d"))
    after = preferred(nodes("a", "b", "d"))
    moved = {job for job in JOBS if before[job] != after[job]}
    assert moved == {job for job in JOBS if before[job] == "c"}


def test_a_node_that_has_not_settled_is_not_preferred() -> None:
    settled = nodes("a", "b")
    newcomer = nodes("c", settled=False)
    assert preferred(settled + newcomer) == preferred(settled)


def test_on_a_cold_start_every_live_node_counts() -> None:
    assert preferred(nodes("a", "b", "c", settled=False)) == preferred(nodes("a", "b", "c"))


def test_only_nodes_that_run_the_job_are_preferred() -> None:
    candidates = nodes("a", "b") + [Candidate("c", frozenset({"job-1"}), True)]
    placement = Placement("a")
    placement.update(candidates, ["job-1", "job-2"])
    assert placement.preferred("job-2") in {"a", "b"}
    # A job that only an unsettled node runs still has a preferred node.
    placement.update([Candidate("z", frozenset({"only-z"}), False), *nodes("a")], ["only-z"])
    assert placement.preferred("only-z") == "z"


def test_may_take_leaves_the_preferred_node_one_round() -> None:
    ids = ["a", "b", "c"]
    placement = Placement("a")
    placement.update(nodes(*ids), JOBS)
    mine = next(job for job in JOBS if placement.preferred(job) == "a")
    theirs = next(job for job in JOBS if placement.preferred(job) != "a")
    assert placement.may_take(mine, seen_free_before=False)
    assert not placement.may_take(theirs, seen_free_before=False)
    assert placement.may_take(theirs, seen_free_before=True)
    assert placement.may_take("unknown-job", seen_free_before=False)


def test_hand_over_is_bounded_and_waits_for_runs_to_end() -> None:
    placement = Placement("a", moves_per_round=2)
    placement.update(nodes("a", "b", "c"), JOBS)
    theirs = [job for job in JOBS if placement.preferred(job) != "a"]
    mine = [job for job in JOBS if placement.preferred(job) == "a"]
    led = theirs[:5] + mine[:3]
    idle = {job: True for job in led} | {theirs[0]: False}
    moving = placement.to_hand_over(led, idle, {"a": 8})
    assert len(moving) == 2
    assert theirs[0] not in moving  # a run is in flight
    assert set(moving) <= set(theirs[1:5])
    assert placement.to_hand_over(mine[:3], dict.fromkeys(mine[:3], True), {"a": 3}) == []


def test_a_node_far_above_its_fair_share_hands_over_half_its_excess() -> None:
    # A cold start where one of ten nodes took all 200 jobs: its fair share is 20, so it
    # hands over 90 in the first round, not two, and the spread takes a few rounds.
    placement = Placement("n0", moves_per_round=2)
    placement.update(nodes(*(f"n{i}" for i in range(10))), JOBS)
    idle = dict.fromkeys(JOBS, True)
    moving = placement.to_hand_over(JOBS, idle, {"n0": len(JOBS)})
    assert len(moving) == (len(JOBS) - 20) // 2
    assert all(placement.preferred(job) != "n0" for job in moving)


def test_hand_over_only_what_evens_the_counts() -> None:
    placement = Placement("a", moves_per_round=10)
    placement.update(nodes("a", "b"), JOBS)
    theirs = [job for job in JOBS if placement.preferred(job) == "b"]
    idle = dict.fromkeys(theirs, True)
    # One job, led by a node that is not preferred for it: balanced enough, it stays.
    assert placement.to_hand_over(theirs[:1], idle, {"a": 1}) == []
    # Six led here, none there: three move, and the counts end within one of each other.
    assert len(placement.to_hand_over(theirs[:6], idle, {"a": 6, "b": 0})) == 3
    assert placement.to_hand_over(theirs[:6], idle, {"a": 6, "b": 5}) == []


def test_moves_per_round_must_be_positive() -> None:
    with pytest.raises(ValueError, match="moves_per_round=0"):
        Placement("a", moves_per_round=0)


def spreader_of(node_id: str, members: list[str], jobs: list[str]) -> tuple[Spreader, FakeClock]:
    """A ``Spreader`` for ``node_id`` whose membership names ``members`` (settled, all
    running ``jobs``), and its clock, a heartbeat (0.1 s) past the membership's change."""
    record = MemberRecord(node_id, f"{node_id}#0", "t", datetime.now(UTC), ttl_s=0.5)
    membership = Membership(record)
    membership.digest = jobs_digest(jobs)
    flat = [item for node in members for item in (f"{node}#0", f"0|{membership.digest}")]
    membership.placed(10_000, "1", flat)
    clock = FakeClock()
    spreader = Spreader(
        node_id, membership=lambda: membership, settle_s=0.5, heartbeat_s=0.1, clock=clock
    )
    return spreader, clock


def first_preferring(order: list[str], members: list[str], count: int = 1) -> list[str]:
    """The first ``count`` job names that rank ``members`` starting with ``order``."""
    names = (f"job-{i}" for i in range(1000))
    found = (j for j in names if rank(j, members)[: len(order)] == order)
    return list(itertools.islice(found, count))


def led(node_id: str, *jobs: str) -> dict[str, Lease]:
    """Leases of ``jobs``, each held by ``node_id`` (this node: token set)."""
    return {job: Lease(job, 0.5, token=1, holder=node_id) for job in jobs}


async def n2_leads_three() -> tuple[Spreader, FakeClock, dict[str, Lease], str, list[str]]:
    """n2 of three nodes leads two jobs of its own and one n1 is preferred for (n2 next);
    its spreader has seen the membership a heartbeat ago."""
    members = ["n1", "n2", "n3"]
    (theirs,) = first_preferring(["n1", "n2"], members)
    mine = first_preferring(["n2"], members, 2)
    leases = led("n2", theirs, *mine)
    spreader, clock = spreader_of("n2", members, [theirs, *mine])
    spreader.refresh(leases)
    await clock.advance(0.1)
    return spreader, clock, leases, theirs, mine


async def test_a_job_is_not_handed_back_to_the_node_that_let_it_go() -> None:
    spreader, clock, leases, theirs, _ = await n2_leads_three()
    # n2 leads 3 jobs, n1 none: n1's job goes back to it...
    assert spreader.to_hand_over(leases) == [theirs]
    # ...unless n1 itself let it go (it stops, or died) while still a member: not for a
    # lock expiry, or until the membership changes.
    spreader.observed(leases, {theirs: "n1"})
    assert spreader.to_hand_over(leases) == []
    await clock.advance(0.5)
    assert spreader.to_hand_over(leases) == [theirs]


async def test_a_node_that_handed_a_job_over_takes_it_back_once_preferred_again() -> None:
    spreader, _, leases, theirs, mine = await n2_leads_three()
    assert spreader.to_hand_over(leases) == [theirs]
    assert not spreader.back_in(theirs)  # n1 is preferred: n2 rests from it
    spreader.placement.update(nodes("n2", "n3", jobs=[theirs, *mine]), [theirs, *mine])
    assert spreader.back_in(theirs)  # n1 left and n2 is preferred: no rest
    leases[theirs].token = 1  # n2 leads it again: the move is over
    spreader.observed(leases, {theirs: "n2"})
    assert not spreader.back_in(theirs)
