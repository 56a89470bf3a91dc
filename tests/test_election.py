"""Election logic on the fake clock and the in-memory store: zero real time."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator, Mapping, Sequence

import pytest

from fastapi_singletonjob._election.elector import Elector
from fastapi_singletonjob._election.lease import Lease
from fastapi_singletonjob._store.base import (
    DEFAULT_CLAIM_TIMEOUT_S,
    DEFAULT_MAX_AHEAD_US,
    ClaimResult,
    LeaseReply,
    LeaseRequest,
)
from fastapi_singletonjob._store.memory import MemoryLeaseStore
from fastapi_singletonjob._timing import lease_deadline, next_attempt_delay, until_beat_s
from fastapi_singletonjob.testing import FakeClock

HEARTBEAT = 1.0
TTL = 3.0


class FlakyStore(MemoryLeaseStore):
    """A memory store that can be made to fail, as an unreachable Redis would."""

    def __init__(self, project: str, clock: FakeClock) -> None:
        super().__init__(project, clock)
        self.down = False
        self.calls = 0
        self.pings = 0
        self.asked: list[list[str]] = []
        """The jobs of each election call, in order."""

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        self.calls += 1
        self.asked.append([request.job for request in requests])
        if self.down:
            raise ConnectionError("store unreachable")
        return await super().elect(node_id, requests)

    async def release(
        self, node_id: str, values: dict[str, str], last_us: Mapping[str, int] | None = None
    ) -> int:
        if self.down:
            raise ConnectionError("store unreachable")
        return await super().release(node_id, values, last_us)

    async def claim(
        self,
        job: str,
        value: str,
        instant_us: int,
        *,
        max_ahead_us: int = DEFAULT_MAX_AHEAD_US,
        timeout_s: float = DEFAULT_CLAIM_TIMEOUT_S,
    ) -> ClaimResult:
        if self.down:
            raise ConnectionError("store unreachable")
        return await super().claim(
            job, value, instant_us, max_ahead_us=max_ahead_us, timeout_s=timeout_s
        )

    async def ping(self) -> None:
        self.pings += 1
        if self.down:
            raise ConnectionError("store unreachable")


class Node:
    def __init__(
        self, name: str, clock: FakeClock, jobs: Sequence[str] = ("job",), ttl_s: float = TTL
    ) -> None:
        self.store = FlakyStore("p", clock)
        self.elector = Elector(
            store=self.store,
            node_id=name,
            leases=[Lease(job, ttl_s) for job in jobs],
            heartbeat_s=HEARTBEAT,
            max_backoff_s=8.0,
            clock=clock,
            rng=lambda: 0.5,
        )
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ready = asyncio.Event()
        self.task = asyncio.create_task(self.elector.run(ready))
        await ready.wait()

    async def kill(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task

    def leads(self, job: str = "job") -> bool:
        return self.elector.is_leader(job)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def nodes(clock: FakeClock) -> AsyncIterator[list[Node]]:
    created = [Node("a", clock), Node("b", clock)]
    yield created
    for node in created:
        if node.task is not None and not node.task.done():
            await node.kill()


async def test_one_node_acquires_at_once_with_deadline_from_send_time(clock: FakeClock) -> None:
    node = Node("a", clock)
    sent = clock.monotonic()
    await node.start()
    await clock.settle()
    lease = node.elector.leases["job"]
    assert node.leads()
    assert lease.token == 1
    assert lease.deadline == lease_deadline(sent, TTL)
    assert sent + TTL * 0.95 < lease.deadline < sent + TTL
    await node.kill()


async def test_two_nodes_elect_exactly_one(clock: FakeClock, nodes: list[Node]) -> None:
    for node in nodes:
        await node.start()
    for _ in range(20):
        await clock.advance(0.5)
        assert sum(node.leads() for node in nodes) == 1
    assert nodes[0].leads()
    assert nodes[0].elector.leases["job"].terms == 1


async def test_follower_knows_the_holder(clock: FakeClock, nodes: list[Node]) -> None:
    for node in nodes:
        await node.start()
    await clock.advance(HEARTBEAT)
    follower = nodes[1].elector.leases["job"]
    assert follower.holder == "a"
    assert follower.holder_token == 1
    assert follower.token is None


async def test_hard_kill_is_taken_over_one_expiry_after_the_last_renewal(
    clock: FakeClock, nodes: list[Node]
) -> None:
    a, b = nodes
    await a.start()
    await clock.settle()
    await b.start()
    await clock.advance(2.2)  # a renewed twice meanwhile
    last_renewal = a.elector.last_success_at
    assert last_renewal is not None and last_renewal > clock.monotonic() - HEARTBEAT
    await a.kill()
    taken_at = None
    for _ in range(400):
        await clock.advance(0.01)
        if b.leads():
            taken_at = clock.monotonic()
            break
    assert taken_at is not None
    # the lock expires TTL after the last renewal; b polls no later than that expiry
    assert last_renewal + TTL <= taken_at <= last_renewal + TTL + 0.02
    assert b.elector.leases["job"].token == 2


async def test_graceful_release_hands_over_without_waiting_for_a_heartbeat(
    clock: FakeClock, nodes: list[Node]
) -> None:
    a, b = nodes
    await a.start()
    await clock.settle()
    await b.start()
    await clock.advance(0.3)
    assert a.leads() and not b.leads()
    await a.kill()
    assert await a.elector.release() == 1
    await clock.settle()  # no time passes
    assert b.leads()
    assert b.elector.leases["job"].token == 2


async def test_unreachable_store_ends_the_term_at_the_deadline(
    clock: FakeClock, nodes: list[Node]
) -> None:
    a = nodes[0]
    await a.start()
    await clock.advance(0.5)
    lease = a.elector.leases["job"]
    deadline, lost = lease.deadline, lease.lost
    a.store.down = True
    while clock.monotonic() < deadline - 0.001:
        assert a.leads() and not lost.is_set()
        await clock.advance(0.05)
    await clock.advance(0.01)
    assert not a.leads()
    assert lost.is_set(), "the term must end at the deadline, not a heartbeat later"
    assert a.elector.failures >= 2
    assert a.elector.last_error == "ConnectionError: store unreachable"


async def test_store_recovery_restores_leadership_with_a_new_token(
    clock: FakeClock, nodes: list[Node]
) -> None:
    a = nodes[0]
    await a.start()
    await clock.advance(0.5)
    a.store.down = True
    await clock.advance(TTL + 1)  # the lock has expired in the store too
    assert not a.leads()
    a.store.down = False
    await clock.advance(8.0)  # at most one max_backoff
    assert a.leads()
    assert a.elector.leases["job"].token == 2


async def test_leader_keeps_the_heartbeat_while_failing(
    clock: FakeClock, nodes: list[Node]
) -> None:
    a = nodes[0]
    await a.start()
    await clock.advance(0.5)
    a.store.down = True
    calls = a.store.calls
    await clock.advance(2.0)
    # at the heartbeat (1 s) despite failures: no backoff while the lease is valid
    assert a.store.calls - calls >= 2


async def test_deleted_lock_starts_a_new_term_for_someone(
    clock: FakeClock, nodes: list[Node]
) -> None:
    a, b = nodes
    await a.start()
    await clock.settle()
    await b.start()
    await clock.advance(0.5)
    a.store.delete_lock("job")  # an operator's DEL
    await clock.advance(HEARTBEAT)
    tokens = [n.elector.leases["job"].token for n in nodes]
    assert sorted(t for t in tokens if t is not None) == [2]
    assert sum(n.leads() for n in nodes) == 1


async def test_blocked_loop_cannot_act_on_an_expired_lease(
    clock: FakeClock, nodes: list[Node]
) -> None:
    a = nodes[0]
    await a.start()
    await clock.advance(0.5)
    assert a.leads()
    clock.stall(TTL)  # the loop was blocked: no round ran, no timer fired
    assert not a.leads(), "validity is read from the clock, not from a flag the loop updates"


async def test_tokens_strictly_increase_across_terms(clock: FakeClock) -> None:
    a, b = Node("a", clock), Node("b", clock)
    tokens: list[int] = []
    for _ in range(5):
        for node in (a, b):
            await node.start()
            await clock.settle()
            token = node.elector.leases["job"].token
            assert token is not None
            tokens.append(token)
            await node.kill()
            await node.elector.release()
    assert tokens == sorted(set(tokens))
    assert len(tokens) == 10


async def test_all_jobs_are_elected_in_one_call_per_round(clock: FakeClock) -> None:
    node = Node("a", clock, jobs=[f"job-{i}" for i in range(50)])
    await node.start()
    await clock.advance(10 * HEARTBEAT - 0.5)
    assert all(node.leads(f"job-{i}") for i in range(50))
    # One call per round, whatever the number of jobs: a round at the start, then one on
    # each beat of the node's grid (half a heartbeat in, rng 0.5) up to the end: 0.5 ... 9.5.
    assert node.store.calls == 11
    await node.kill()


@pytest.mark.parametrize(
    ("failures", "leading", "holder_ttl", "jitter", "sent_at", "expected"),
    [
        (0, False, None, 0.0, 0.0, 1.0),
        (0, False, None, 0.9, 0.0, 1.0),  # healthy rounds have no jitter: the beat decides
        (0, True, None, 0.5, 100.25, 0.75),  # a round off the beat: the next is on it
        (0, False, 0.25, 0.9, 0.0, 0.251),
        (0, False, 5.0, 0.0, 0.0, 1.0),
        (1, True, None, 0.9, 0.5, 1.0),
        (1, False, None, 0.0, 0.0, 1.0),
        (1, False, None, 0.999999, 0.0, 2.0),
        (2, False, None, 0.0, 0.0, 2.0),
        (3, False, None, 0.5, 0.0, 6.0),
        (10, False, None, 0.0, 0.0, 15.0),
        (10, False, None, 0.999999, 0.0, 30.0),
        (10_000, False, None, 0.0, 0.0, 15.0),
    ],
)
def test_next_attempt_delay(
    failures: int,
    leading: bool,
    holder_ttl: float | None,
    jitter: float,
    sent_at: float,
    expected: float,
) -> None:
    delay = next_attempt_delay(
        heartbeat_s=1.0,
        max_backoff_s=30.0,
        failures=failures,
        leading=leading,
        holder_ttl_s=holder_ttl,
        jitter=jitter,
        sent_at=sent_at,
    )
    assert delay == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("heartbeat", [0.2, 1.0, 3.0])
@pytest.mark.parametrize("phase", [0.0, 0.37, 0.999])
def test_rounds_keep_to_the_nodes_own_beat_whatever_extra_rounds_come_between(
    heartbeat: float, phase: float
) -> None:
    """Healthy rounds fall on the node's grid (``phase`` of a heartbeat plus whole ones):
    never more than a heartbeat apart, and an extra round (a notice woke it) does not move
    the grid, so nodes that a notice woke together do not go on renewing together."""
    rng = random.Random(7)
    sent_at = 1000.0 + rng.random() * 5
    beats = []
    for _ in range(200):
        delay = until_beat_s(sent_at, heartbeat, phase)
        assert 0.01 * heartbeat - 1e-9 <= delay <= heartbeat + 1e-9
        beat = sent_at + delay
        beats.append(beat)
        room = delay - 0.02 * heartbeat  # a notice: a round between beats, not on one
        extra = room > 0 and rng.random() < 0.3
        sent_at = beat - (0.02 * heartbeat + rng.random() * room) if extra else beat + 0.002
    on_grid = [((b / heartbeat - phase) % 1.0) for b in beats[1:]]
    assert max(min(x, 1 - x) for x in on_grid) < 1e-6, on_grid


def test_nodes_with_different_phases_spread_their_rounds_over_the_heartbeat() -> None:
    phases = [i / 50 for i in range(50)]
    sent_at = 2000.0  # all woken by the same notice
    beats = sorted((sent_at + until_beat_s(sent_at, 3.0, p)) % 3.0 for p in phases)
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    assert max(gaps) < 0.1


def test_backoff_never_exceeds_the_cap() -> None:
    for failures in range(1, 40):
        for jitter in (0.0, 0.3, 0.999):
            delay = next_attempt_delay(
                heartbeat_s=0.2,
                max_backoff_s=3.0,
                failures=failures,
                leading=False,
                holder_ttl_s=None,
                jitter=jitter,
            )
            assert 0.1 <= delay <= 3.0


@pytest.mark.parametrize("ttl", [0.05, 0.5, 10.0, 3600.0])
def test_lease_deadline_is_before_the_server_expiry(ttl: float) -> None:
    deadline = lease_deadline(100.0, ttl)
    assert 100.0 < deadline < 100.0 + ttl * (1 - 1e-3)


async def test_a_node_that_stopped_acquiring_keeps_its_terms_and_starts_none(
    clock: FakeClock,
) -> None:
    """Shutdown (draining) sets ``acquiring`` off: held leases are still renewed for the runs
    in flight, free locks are not requested, and a grant that was already on its way (a round
    sent before) starts no term: the lock is released after that round."""
    node = Node("a", clock, jobs=("held", "free", "late"))
    node.elector.leases["free"].wanted = node.elector.leases["late"].wanted = False
    await node.elector.round()
    assert node.leads("held")
    node.elector.leases["free"].wanted = node.elector.leases["late"].wanted = True
    node.elector.stop_acquiring()
    sent = clock.monotonic()
    node.elector.terms.apply([LeaseReply("late", True, "7|a#nonce", TTL)], sent, None)
    assert not node.leads("late") and not node.elector.leases["late"].wanted
    for _ in range(3):
        await node.elector.round()
        await clock.advance(HEARTBEAT)
    assert node.leads("held"), "renewed while draining"
    assert not node.leads("free") and node.elector.leases["free"].terms == 0
    assert node.elector.leases["free"].holder is None, "never even asked for"


async def test_a_follower_asks_about_a_held_job_only_when_its_lease_may_end_first(
    clock: FakeClock,
) -> None:
    """While the leader renews, a follower leaves the job out of its rounds except when the
    lease it last saw would end before its next round; it still takes over one lock expiry
    after the leader's last renewal."""
    ttl_s = 10 * HEARTBEAT
    a, b = Node("a", clock, ttl_s=ttl_s), Node("b", clock, ttl_s=ttl_s)
    await a.start()
    await clock.advance(0.01)
    await b.start()
    for _ in range(round(3 * ttl_s / 0.05)):
        await clock.advance(0.05)
    asked = b.store.asked
    assert asked[0] == ["job"], "the first round asks about everything"
    rounds = b.store.calls + b.store.pings
    print(f"follower rounds: {rounds}, asking about the held job: {len(asked)}")
    assert a.leads() and not b.leads()
    assert len(asked) <= rounds // 2, (rounds, asked)
    await a.kill()
    killed_at = clock.monotonic()
    while not b.leads():
        await clock.advance(0.01)
        assert clock.monotonic() - killed_at <= ttl_s + HEARTBEAT, "no takeover"
    assert clock.monotonic() - killed_at >= ttl_s - 2 * HEARTBEAT
    await b.kill()
