"""Placement (``placement="spread"``): rendezvous ranking, jobs shared out evenly, stable under
churn, hand-overs that converge; pure logic."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from datetime import UTC, datetime

import pytest

from fastapi_singletonjob._election.lease import Lease
from fastapi_singletonjob._election.placement import (
    Candidate,
    Placement,
    Spreader,
    rank,
    share_out,
)
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


@pytest.mark.parametrize("replicas", [3, 7, 10, 50, 250])
def test_leadership_is_shared_out_evenly(replicas: int) -> None:
    ids = [f"web-{i}" for i in range(replicas)]
    led = Counter(preferred(nodes(*ids)).values())
    counts = [led[node] for node in ids]
    print(f"{replicas} replicas x {len(JOBS)} jobs: {min(counts)} to {max(counts)} each")
    assert max(counts) - min(counts) <= 1  # with more nodes than jobs: one job or none


def test_twelve_jobs_over_three_replicas_are_shared_four_four_four_whatever_the_ids() -> None:
    # Rendezvous hashing alone is dice: about one id triple in six ranks a node first for
    # one job of twelve or none (5/6/1 in issue 26, item 3).
    jobs = [f"job-{i:02d}" for i in range(12)]
    rng = random.Random(26)
    for _ in range(200):
        ids = [f"web-{rng.getrandbits(32):08x}" for _ in range(3)]
        counts = Counter(preferred(nodes(*ids, jobs=jobs), jobs).values())
        assert sorted(counts.values()) == [4, 4, 4], (ids, counts)


def test_a_join_gives_the_newcomer_its_share_and_changes_few_other_preferences() -> None:
    before = preferred(nodes("a", "b", "c"))
    after = preferred(nodes("a", "b", "c", "d"))
    moved = [job for job in JOBS if before[job] != after[job]]
    assert sum(after[job] == "d" for job in moved) == len(JOBS) // 4
    # The other nodes' room shrank: a few jobs change hands between them too (in the
    # preferences; the election moves them only from a node above its share).
    assert len(moved) - len(JOBS) // 4 <= len(JOBS) // 20, moved


def test_a_leave_changes_the_leavers_jobs_and_few_others() -> None:
    before = preferred(nodes("a", "b", "c", "d"))
    after = preferred(nodes("a", "b", "d"))
    moved = {job for job in JOBS if before[job] != after[job]}
    assert moved >= {job for job in JOBS if before[job] == "c"}
    assert len(moved) - len(JOBS) // 4 <= len(JOBS) // 20, moved


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
    # Whatever the job sets: the preferred node runs the job.
    rng = random.Random(3)
    for _ in range(100):
        sets = {f"n{i}": frozenset(rng.sample(JOBS[:30], rng.randrange(31))) for i in range(4)}
        placement.update([Candidate(n, run, True) for n, run in sets.items()], JOBS[:30])
        for job in JOBS[:30]:
            runners: set[str | None] = {n for n, run in sets.items() if job in run}
            assert placement.preferred(job) in (runners or {None}), (job, sets)
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
    membership.digest = jobs_digest(dict.fromkeys(jobs, "interval every 1s"))
    flat = [item for node in members for item in (f"{node}#0", f"0|{membership.digest}")]
    membership.placed(10_000, "1", flat)
    clock = FakeClock()
    spreader = Spreader(
        node_id, membership=lambda: membership, settle_s=0.5, heartbeat_s=0.1, clock=clock
    )
    return spreader, clock


def six_jobs() -> tuple[list[str], str, list[str]]:
    """Six jobs shared out over n1, n2 and n3, two each: one of n1's that n2 is preferred for
    once n1 is gone, and n2's two."""
    for start in itertools.count(0, 6):
        jobs = [f"job-{i}" for i in range(start, start + 6)]
        three = share_out(jobs, dict.fromkeys(["n1", "n2", "n3"], frozenset(jobs)))
        two = share_out(jobs, dict.fromkeys(["n2", "n3"], frozenset(jobs)))
        theirs = [job for job in jobs if three[job] == "n1" and two[job] == "n2"]
        if theirs:
            return jobs, theirs[0], [job for job in jobs if three[job] == "n2"]
    raise AssertionError("unreachable")


def led(node_id: str, *jobs: str) -> dict[str, Lease]:
    """Leases of ``jobs``, each held by ``node_id`` (this node: token set)."""
    return {job: Lease(job, 0.5, token=1, holder=node_id) for job in jobs}


async def n2_leads_three() -> tuple[Spreader, FakeClock, dict[str, Lease], str, list[str]]:
    """n2 of three nodes leads its two jobs and one n1 is preferred for (n2 once n1 is gone);
    nobody is known to lead the other three; its spreader has seen the membership a
    heartbeat ago."""
    jobs, theirs, mine = six_jobs()
    leases = {job: Lease(job, 0.5) for job in jobs} | led("n2", theirs, *mine)
    spreader, clock = spreader_of("n2", ["n1", "n2", "n3"], jobs)
    spreader.refresh(leases)
    await clock.advance(0.1)
    return spreader, clock, leases, theirs, mine


async def test_a_job_is_not_handed_back_to_the_node_that_let_it_go() -> None:
    spreader, clock, leases, theirs, _ = await n2_leads_three()
    # n2 leads 3 jobs, n1 none: n1's job goes back to it...
    assert spreader.to_hand_over(leases) == [theirs]
    # ...unless n1 itself let it go (it stops, or died) while still a member: not for a
    # lock expiry, or until the membership changes.
    spreader.observed(leases, {theirs: "n1"}, clock.monotonic())
    assert spreader.to_hand_over(leases) == []
    await clock.advance(0.5)
    assert spreader.to_hand_over(leases) == [theirs]


async def test_a_node_that_handed_a_job_over_takes_it_back_once_preferred_again() -> None:
    spreader, _, leases, theirs, mine = await n2_leads_three()
    assert spreader.to_hand_over(leases) == [theirs]
    assert not spreader.back_in(theirs)  # n1 is preferred: n2 rests from it
    jobs = list(leases)
    spreader.placement.update(nodes("n2", "n3", jobs=jobs), jobs)
    assert spreader.back_in(theirs)  # n1 left and n2 is preferred: no rest
    leases[theirs].token = 1  # n2 leads it again: the move is over
    spreader.observed(leases, {theirs: "n2"}, 0.0)
    assert not spreader.back_in(theirs)


def test_a_node_above_its_share_hands_over_though_the_preferred_node_is_one_job_behind() -> None:
    # Leads 5/4/3 on three nodes whose shares are 4: a leads one of b's jobs, b one of c's.
    # Each node is only one job ahead of the next, but a is above its share: it hands b's job
    # over, then b (five now) hands c's over. A two-job margin alone stalled here.
    jobs = JOBS[:12]
    views = {node: Placement(node) for node in "abc"}
    for view in views.values():
        view.update(nodes("a", "b", "c", jobs=jobs), jobs)
    share = {node: [job for job in jobs if views["a"].preferred(job) == node] for node in "abc"}
    assert [len(share[node]) for node in "abc"] == [4, 4, 4]
    a_leads = share["a"] + share["b"][:1]
    b_leads = share["b"][1:] + share["c"][:1]
    idle = dict.fromkeys(jobs, True)
    assert views["a"].to_hand_over(a_leads, idle, {"a": 5, "b": 4, "c": 3}) == share["b"][:1]
    assert views["b"].to_hand_over(b_leads, idle, {"a": 4, "b": 4, "c": 3}) == []
    b_leads.append(share["b"][0])
    assert views["b"].to_hand_over(b_leads, idle, {"a": 4, "b": 5, "c": 3}) == share["c"][:1]
    assert views["c"].to_hand_over(share["c"], idle, {"a": 4, "b": 4, "c": 4}) == []


def hand_over_rounds(
    ids: list[str], jobs: list[str], leaders: dict[str, str], rng: random.Random, rounds: int
) -> list[tuple[list[int], int]]:
    """Play the hand-over rule alone for ``rounds`` rounds from ``leaders`` (job -> node,
    changed in place); return, for each round, the jobs each node led as it began and the
    moves made in it.

    In each round every node, in a shuffled order, decides from the counts as they were when
    the round began (its own as they are: what a node last saw of the others is up to a round
    old), with a run in flight for each job with odds 1 in 4 (such a move waits for a later
    round); a job handed over goes to its preferred node (it takes it at the notice)."""
    views = {node: Placement(node) for node in ids}
    for view in views.values():
        view.update(nodes(*ids, jobs=jobs), jobs)
    played = []
    for _ in range(rounds):
        counts = Counter(leaders.values())
        moved = 0
        for node in rng.sample(ids, len(ids)):
            led = [job for job, leader in leaders.items() if leader == node]
            idle = {job: rng.random() >= 0.25 for job in led}
            for job in views[node].to_hand_over(led, idle, counts | {node: len(led)}):
                preferred = views[node].preferred(job)
                assert preferred is not None and preferred != node
                leaders[job] = preferred
                moved += 1
        played.append(([counts[node] for node in ids], moved))
    return played


BALANCED_ROUNDS = 12
"""Bound on the rounds until the leads of any configuration of the test below differ by one
job at most (11 measured over 1,500 configurations; 8 when each node sees the moves made
before its turn, as the release notices let it)."""


def test_every_configuration_balances_within_a_few_rounds_and_then_nothing_moves() -> None:
    """From any leads (random, all on one node, or each job on the node after the one it is
    shared out to), 2 to 6 nodes and 1 to 40 jobs: within ``BALANCED_ROUNDS`` rounds the
    leads differ by one job at most, every move takes a job to its preferred node, and once
    balanced nothing moves."""
    rng = random.Random(326)
    worst = 0
    for case in range(600):
        ids = [f"n{rng.getrandbits(32):08x}" for _ in range(rng.randint(2, 6))]
        jobs = [f"job-{i}" for i in range(rng.randint(1, 40))]
        if case % 3 == 0:
            leaders = {job: rng.choice(ids) for job in jobs}
        elif case % 3 == 1:
            leaders = dict.fromkeys(jobs, ids[0])
        else:
            shares = share_out(jobs, dict.fromkeys(ids, frozenset(jobs)))
            leaders = {job: ids[(ids.index(shares[job]) + 1) % len(ids)] for job in jobs}
        played = hand_over_rounds(ids, jobs, leaders, rng, BALANCED_ROUNDS + 10)
        spread = [max(counts) - min(counts) for counts, _ in played]
        balanced_at = next((i for i, gap in enumerate(spread) if gap <= 1), len(spread))
        worst = max(worst, balanced_at)
        assert balanced_at <= BALANCED_ROUNDS, (ids, jobs, played)
        assert not any(moved for _, moved in played[balanced_at:]), (ids, jobs, played)
    print(f"worst case: balanced after {worst} rounds")


async def test_a_lock_preferred_elsewhere_waits_a_heartbeat_from_when_it_was_first_seen_free() -> (
    None
):
    """The preferred node gets a heartbeat to take a free lock, counted from the round that
    first found it free, not from when this node last saw its holder: a follower that has
    not asked about a job for a while (it is not its watcher) and finds it free after a
    release did not take it at once (a leave sent its jobs to whichever survivor asked first,
    and the survivors handed them on)."""
    jobs, theirs, _ = six_jobs()
    spreader, clock = spreader_of("n2", ["n1", "n2", "n3"], jobs)
    leases = {job: Lease(job, 0.5) for job in jobs}
    spreader.refresh(leases)
    lease = leases[theirs]  # n1 is preferred; n2 last saw it held by n3, 2 s ago
    lease.observed_at = clock.monotonic() - 2.0
    spreader.observed(leases, {theirs: "n3"}, clock.monotonic())  # now it is free
    assert not spreader.take(lease)
    await clock.advance(0.05)
    assert not spreader.take(lease)
    spreader.observed(leases, {theirs: None}, clock.monotonic())  # still free
    await clock.advance(0.05)
    assert spreader.take(lease)  # a heartbeat (0.1 s) after it was first seen free
