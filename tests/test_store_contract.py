"""The lease-store contract, run against every store on real time.

Every test in the first part runs three times: on :class:`MemoryLeaseStore` with the system
clock, on :class:`RedisLeaseStore` against the suite's shared redis-server, and on
:class:`ClusterLeaseStore` against a Redis Cluster of three masters started for this module.
The second part checks what only Redis has: its keys, scripts, memory, client handling and
authentication.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
import redis
import redis.asyncio
from redis_cluster import TestCluster
from servers import RedisServer, RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob._checkpoint import FinishedRun, from_unix_us, to_unix_us
from fastapi_singletonjob._clock import SystemClock
from fastapi_singletonjob._history import cursor_of
from fastapi_singletonjob._lock_value import SHOWN_VALUE_CHARS
from fastapi_singletonjob._outcomes import Outcome
from fastapi_singletonjob._store import keys as _keys
from fastapi_singletonjob._store.base import (
    LeaseReply,
    LeaseRequest,
    OverdueCheck,
    Store,
    parse_notice,
)
from fastapi_singletonjob._store.membership import MemberRecord, Membership, jobs_digest
from fastapi_singletonjob._store.memory import MemoryLeaseStore
from fastapi_singletonjob._store.redis.cluster import ClusterLeaseStore
from fastapi_singletonjob._store.redis.store import RedisLeaseStore

TTL_S = 1.0
NOW = datetime(2026, 1, 1, tzinfo=UTC)
TTL_MS = round(TTL_S * 1000)
# Redis keeps expiries in whole milliseconds; the memory store is exact.
MS = 0.002
# MEMORY USAGE counts the key, the value and the server's per-key overhead: Redis 7.0 says 152
# and 88 bytes for a 30-character node id; the bounds leave room for other server builds.
LOCK_BYTES_MAX = 200
FENCE_BYTES_MAX = 120


@dataclass
class Case:
    """One store under test, how to count its release subscribers, and how to write a lock
    as an operator (or another program) would: ``set_lock(job, value, ttl_s)``."""

    store: Store
    subscribers: Callable[[], int]
    set_lock: Callable[[str, str, float], None]


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[TestCluster]:
    with TestCluster.start(masters=3) as cluster:
        yield cluster


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.redis),
    ]
)
async def case(request: pytest.FixtureRequest, unique_project: str) -> AsyncIterator[Case]:
    if request.param == "memory":
        memory = MemoryLeaseStore(unique_project, SystemClock())
        yield Case(memory, lambda: len(memory._data.listeners), memory.set_lock)
        await memory.aclose()
        return
    if request.param == "cluster":
        cluster: TestCluster = request.getfixturevalue("redis_cluster")
        async with cluster_case(cluster, unique_project) as found:
            yield found
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    url: str = request.getfixturevalue("redis_url")
    store = RedisLeaseStore(unique_project, url=url)
    channel = _keys.release_channel(unique_project)
    with server.client() as inspector:

        def subscribers() -> int:
            counts = dict(inspector.pubsub_numsub(channel))
            return int(counts.get(channel, 0))

        def set_lock(job: str, value: str, ttl_s: float) -> None:
            inspector.set(_keys.job_key(unique_project, job, "lock"), value, px=round(ttl_s * 1000))

        try:
            yield Case(store, subscribers, set_lock)
        finally:
            await store.aclose()


@contextlib.asynccontextmanager
async def cluster_case(cluster: TestCluster, project: str) -> AsyncIterator[Case]:
    """The case of a ``ClusterLeaseStore``: its keys and channel live on the slot's master."""
    store = ClusterLeaseStore(project, url=cluster.url)
    # Read the slot map now: a test's first call must not spend a short lock's TTL on it.
    await store.ping()
    channel = _keys.release_channel(project)
    with cluster.owner_of(channel).client() as inspector:

        def subscribers() -> int:
            return int(inspector.pubsub_shardnumsub(channel)[0][1])

        def set_lock(job: str, value: str, ttl_s: float) -> None:
            inspector.set(_keys.job_key(project, job, "lock"), value, px=round(ttl_s * 1000))

        try:
            yield Case(store, subscribers, set_lock)
        finally:
            await store.aclose()


async def elect_one(
    store: Store, node: str, ttl_s: float = TTL_S, held: str | None = None
) -> LeaseReply:
    [reply] = await store.elect(node, [LeaseRequest("job", ttl_s, held)])
    return reply


async def new_term(store: Store, node: str) -> int:
    """Acquire the (free) lock; return the new term's token."""
    reply = await elect_one(store, node)
    assert reply.held and reply.token is not None, reply
    return reply.token


# --- both stores -------------------------------------------------------------------------------


async def test_acquire_free_lock(case: Case) -> None:
    reply = await elect_one(case.store, "n1")

    assert reply.job == "job"
    assert reply.held
    assert reply.holder == "n1"
    assert reply.token is not None and reply.token > 0
    assert reply.value == f"{reply.token}|n1"
    assert reply.ttl_s == pytest.approx(TTL_S, abs=MS)


async def test_renew_keeps_token_and_resets_ttl(case: Case) -> None:
    first = await elect_one(case.store, "n1", ttl_s=2.0)
    await asyncio.sleep(0.3)  # let the lease run down, to see the renewal restore it
    before = await elect_one(case.store, "n2", ttl_s=2.0)

    renewed = await elect_one(case.store, "n1", ttl_s=2.0, held=first.value)
    after = await elect_one(case.store, "n2", ttl_s=2.0)

    assert renewed.held and renewed.token == first.token and renewed.value == first.value
    assert renewed.ttl_s == pytest.approx(2.0, abs=MS)
    assert before.ttl_s is not None and after.ttl_s is not None
    assert before.ttl_s <= 2.0 - 0.3 + MS
    assert after.ttl_s > before.ttl_s  # the renewal moved the expiry later


async def test_a_lock_from_an_ended_term_is_not_renewed(case: Case) -> None:
    """A node that stepped down (say its renewal's reply was lost) asks without a held value:
    its old lock must run out, not be kept alive by the node that no longer acts on it."""
    # A lock that outlives the calls on a busy machine (at 0.5 s it once ran out between
    # them on a cluster, and the second call took it anew).
    first = await elect_one(case.store, "n1", ttl_s=3.0)
    await asyncio.sleep(0.2)
    again = await elect_one(case.store, "n1", ttl_s=3.0)  # no held value: the term ended
    assert not again.held
    assert again.value == first.value
    assert again.ttl_s is not None and again.ttl_s <= 3.0 - 0.2 + MS


async def test_other_node_sees_holder_and_ttl(case: Case) -> None:
    sent_at = time.monotonic()
    mine = await elect_one(case.store, "n1")
    theirs = await elect_one(case.store, "n2")
    elapsed = time.monotonic() - sent_at

    assert not theirs.held
    assert theirs.holder == "n1"
    assert theirs.token == mine.token
    assert theirs.value == mine.value
    assert theirs.ttl_s is not None
    assert TTL_S - elapsed - MS <= theirs.ttl_s <= TTL_S


async def test_expiry_lets_another_node_acquire_with_greater_token(case: Case) -> None:
    ttl_s = 0.3
    sent_at = time.monotonic()
    first = await elect_one(case.store, "n1", ttl_s)
    assert first.held and first.token is not None
    second: list[LeaseReply] = []

    async def n2_acquires() -> bool:
        second[:] = [await elect_one(case.store, "n2", ttl_s)]
        return second[0].held

    acquired_at = await wait_until(n2_acquires, 3.0, "n2 acquires the expired lock", poll_s=0.01)

    assert acquired_at - sent_at >= ttl_s - MS  # not before the lease ran out
    assert second[0].holder == "n2"
    assert second[0].token is not None and second[0].token > first.token


async def test_release_deletes_only_the_value_given(case: Case) -> None:
    # A later term of the same node: the lock of the first term expired, and n1 took it again.
    old = await elect_one(case.store, "n1", 0.05)
    await asyncio.sleep(0.1)  # twice the lease: it has run out (time passing is the point)
    current = await elect_one(case.store, "n1")
    assert old.value is not None and current.value is not None
    assert current.held and current.token is not None and old.token is not None
    assert current.token > old.token

    assert await case.store.release("n1", {"job": old.value}) == 0
    assert await case.store.release("n2", {"job": f"{current.token}|n2"}) == 0
    assert await case.store.release("n2", {"job": "not-a-lock-value"}) == 0
    assert await case.store.release("n1", {"other-job": current.value}) == 0
    still = await elect_one(case.store, "n2")
    assert not still.held and still.value == current.value

    assert await case.store.release("n1", {"job": current.value}) == 1
    taken = await elect_one(case.store, "n2")
    assert taken.held and taken.token is not None and taken.token > (current.token or 0)
    assert await case.store.release("n1", {"job": current.value}) == 0  # n2's lock stays
    assert (await elect_one(case.store, "n1")).holder == "n2"


async def test_release_notifies_subscriber(case: Case) -> None:
    calls: list[float] = []
    listener = asyncio.create_task(case.store.listen_releases(lambda _jobs: calls.append(0.0)))
    try:
        await wait_until(lambda: case.subscribers() >= 1, 2.0, "the listener subscribed")
        mine = await elect_one(case.store, "n1")
        assert mine.value is not None

        assert await case.store.release("n1", {"job": "1|somebody-else"}) == 0  # no notice
        assert await case.store.release("n1", {"job": mine.value}) == 1
        await wait_until(lambda: len(calls) >= 1, 2.0, "the release notice")
        # A second release as a sentinel: notices arrive in order, so a notice of the failed
        # release above would show up as a third call by the time this one arrives.
        again = await elect_one(case.store, "n1")
        assert again.value is not None
        assert await case.store.release("n1", {"job": again.value}) == 1
        await wait_until(lambda: len(calls) >= 2, 2.0, "the second release notice")
        assert len(calls) == 2
        assert not listener.done()
    finally:
        listener.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listener
    await wait_until(lambda: case.subscribers() == 0, 2.0, "the listener unsubscribed")


async def test_a_release_notice_names_the_jobs_released(case: Case) -> None:
    heard: list[frozenset[str] | None] = []
    listener = asyncio.create_task(case.store.listen_releases(heard.append))
    try:
        await wait_until(lambda: case.subscribers() >= 1, 2.0, "the listener subscribed")
        jobs = ["job-a", "job.b", "job_c"]
        mine = await case.store.elect("n1", [LeaseRequest(job, TTL_S) for job in jobs])
        values = {reply.job: reply.value for reply in mine if reply.value is not None}
        assert set(values) == set(jobs), mine
        values["job_c"] = "1|somebody-else"  # not released, so not named
        assert await case.store.release("n1", values) == 2
        await wait_until(lambda: len(heard) >= 1, 2.0, "the release notice")
        # The others ask about these jobs only, not about every job.
        assert heard == [frozenset({"job-a", "job.b"})]
    finally:
        listener.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listener


async def test_a_control_notice_names_its_job(case: Case) -> None:
    """An operator's control wakes the other nodes for a round about that job only, not
    about every job (which, with many jobs and replicas, would cost Redis a full round of
    every replica at each ``pause``)."""
    heard: list[frozenset[str] | None] = []
    listener = asyncio.create_task(case.store.listen_releases(heard.append))
    try:
        await wait_until(lambda: case.subscribers() >= 1, 2.0, "the listener subscribed")
        await case.store.set_control(_keys.control_field("paused", "job:with:colons"), "{}")
        await case.store.set_control(_keys.control_field("trigger", "job-b"), "1")
        await wait_until(lambda: len(heard) >= 2, 2.0, "the control notices")
        assert heard == [frozenset({"job:with:colons"}), frozenset({"job-b"})]
    finally:
        listener.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listener


async def test_issue27_item3_a_reset_leaves_its_holder_a_one_shot_control(case: Case) -> None:
    """``reset_checkpoint`` deletes the record and, in the same call, leaves the lock's holder
    a control that only its next ``elect`` reports (once), and wakes every node's election."""
    heard: list[frozenset[str] | None] = []
    listener = asyncio.create_task(case.store.listen_releases(heard.append))
    try:
        await wait_until(lambda: case.subscribers() >= 1, 2.0, "the listener subscribed")
        assert await case.store.reset_checkpoint("job") is False, "nobody leads: no record"
        holder = await elect_one(case.store, "n1", ttl_s=5.0)
        assert holder.held and not holder.checkpoint_reset, "no control without a leader"
        token = holder.token
        assert token is not None
        run = FinishedRun("job", token, "n1", Outcome.SUCCESS, NOW, None, 60.0)
        assert (await case.store.record_runs([run])).iterations == [1]
        assert await case.store.reset_checkpoint("job") is True
        assert await case.store.read_checkpoint("job") is None
        await wait_until(lambda: len(heard) >= 1, 2.0, "the reset's notice")
        assert heard == [frozenset({"job"})]
        follower = await elect_one(case.store, "n2", ttl_s=5.0)
        assert not follower.held and not follower.checkpoint_reset, "the holder's only"
        renewed = await elect_one(case.store, "n1", ttl_s=5.0, held=holder.value)
        assert renewed.held and renewed.checkpoint_reset
        again = await elect_one(case.store, "n1", ttl_s=5.0, held=holder.value)
        assert again.held and not again.checkpoint_reset, "taken once"
    finally:
        listener.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listener


async def test_many_jobs_in_one_elect(case: Case) -> None:
    jobs = [f"job-{i}" for i in range(5)]
    mine = await case.store.elect("n1", [LeaseRequest(job, TTL_S) for job in jobs])

    assert [r.job for r in mine] == jobs
    assert all(r.held and r.holder == "n1" for r in mine)
    assert all(r.ttl_s == pytest.approx(TTL_S, abs=MS) for r in mine)

    mixed = [LeaseRequest("job-3", TTL_S), LeaseRequest("new", 0.5), LeaseRequest("job-0", TTL_S)]
    theirs = await case.store.elect("n2", mixed)

    assert [r.job for r in theirs] == ["job-3", "new", "job-0"]
    assert [r.held for r in theirs] == [False, True, False]
    assert [r.holder for r in theirs] == ["n1", "n2", "n1"]
    assert theirs[0].value == mine[3].value and theirs[2].value == mine[0].value
    assert theirs[1].ttl_s == pytest.approx(0.5, abs=MS)

    released = await case.store.release("n1", {r.job: r.value for r in mine if r.value})
    assert released == 5


def is_stored(member: Membership) -> bool:
    """``member.stored``, read afresh (mypy would narrow the attribute across calls)."""
    return member.stored


async def test_an_updated_membership_record_is_stored_whole_with_its_new_digest(
    case: Case,
) -> None:
    """A job that retires leaves the node's record and its placement digest in the next
    call: the record is sent whole again, the placement entry keeps its join time and takes
    the new digest, and the epoch moves, so every node places the jobs anew."""
    store = case.store
    record = MemberRecord("n1", "n1#1", "0", datetime.now(UTC), {"a": "x", "b": "y"}, 5)
    member = Membership(record)
    store.announce(member)
    await store.elect("n1#1", [LeaseRequest("a", TTL_S)])
    assert is_stored(member)
    joined, digest = member.peers["n1#1"]
    epoch = member.epoch
    assert digest == jobs_digest({"a": "x", "b": "y"})

    member.drop_jobs(["b"])
    assert not is_stored(member) and member.digest == jobs_digest({"a": "x"})
    await store.elect("n1#1", [LeaseRequest("a", TTL_S)])

    assert is_stored(member)
    assert member.epoch != epoch
    assert member.peers["n1#1"] == (joined, jobs_digest({"a": "x"}))
    if not isinstance(store, ClusterLeaseStore):  # read_cluster fails there: a pipelined TIME
        read = await store.read_cluster()
        [stored] = [m for m, _ in read.members if m.owner == "n1#1"]
        assert stored.jobs == {"a": "x"}


def test_a_call_sent_before_an_update_does_not_confirm_the_new_record() -> None:
    record = MemberRecord("n1", "n1#1", "0", datetime.now(UTC), {"a": "x", "b": "y"}, 5)
    member = Membership(record)
    member.confirmed(bool(member.payload()))
    assert is_stored(member) and member.payload() == ""  # an election call in flight
    member.drop_jobs(["b"])
    member.confirmed(True)  # its answer: the old record is stored
    assert not is_stored(member) and '"b"' not in member.payload()


async def test_claim_records_each_instant_once_for_the_holder(case: Case) -> None:
    store = case.store
    token = await new_term(store, "n1")
    value = f"{token}|n1"
    assert await store.claim("job", value, 1_000) == 1
    # The same term claiming the same instant again is a retry after a lost reply: its own.
    assert await store.claim("job", value, 1_000) == 1, "this term's own claim, retried"
    assert await store.claim("job", value, 999) == 0, "an earlier instant"
    assert await store.claim("job", "1|someone-else", 2_000) == -1, "not the holder"
    assert await store.claim("job", value, 2_000) == 1


async def test_claims_survive_a_change_of_leader(case: Case) -> None:
    store = case.store
    first = await new_term(store, "n1")
    assert await store.claim("job", f"{first}|n1", 5_000) == 1
    assert await store.release("n1", {"job": f"{first}|n1"}) == 1
    second = await new_term(store, "n2")
    assert await store.claim("job", f"{second}|n2", 5_000) == 0, "already run by n1"
    assert await store.claim("job", f"{second}|n2", 5_000) == 0, "still n1's, retried"
    assert await store.claim("job", f"{second}|n2", 6_000) == 1


async def test_issue30_the_history_mark_keeps_a_terms_own_entries_apart(case: Case) -> None:
    """Each history entry moves the record's mark to the latest instant it stands for; a
    new term reads where the terms before it left the history, even once its own first
    entries are in (they may reach Redis before its read); a missed entry of several
    instants carries their count and last one; a missed entry creates no record."""
    store = case.store
    us = 1_700_000_000_000_000

    def entry(token: int, node: str, first_us: int, **kwargs: object) -> FinishedRun:
        return FinishedRun(
            "job",
            token,
            node,
            Outcome.SUCCESS,
            from_unix_us(first_us),
            None,
            60.0,
            history=10,
            **kwargs,  # type: ignore[arg-type]
        )

    first = await new_term(store, "n1")
    gap = entry(first, "n1", us, missed="paused")
    assert (await store.record_runs([gap])).iterations == [0]
    assert (await store.load_checkpoint("job"))[::2] == (None, None), "no record made"
    await store.record_runs([entry(first, "n1", us + 1_000_000)])
    many = entry(
        first,
        "n1",
        us + 2_000_000,
        missed="no_leader",
        instants=3,
        last_at=from_unix_us(us + 4_000_000),
    )
    unknown = entry(first, "n1", us + 5_000_000, missed="misfire_skipped", instants=0)
    await store.record_runs([many, unknown])
    _, _, mark = await store.load_checkpoint("job")
    assert cursor_of(mark, first) is None, "nothing before the first term"
    assert cursor_of(mark, first + 1) == us + 5_000_000
    [newest, counted, *_] = await store.read_history("job", limit=10)
    assert (newest.count, newest.last_at, newest.reason) == (None, None, "misfire_skipped")
    assert (counted.count, counted.last_at) == (3, from_unix_us(us + 4_000_000))

    assert await store.release("n1", {"job": f"{first}|n1"}) == 1
    second = await new_term(store, "n2")
    await store.record_runs([entry(second, "n2", us + 9_000_000, missed="paused")])
    _, _, mark = await store.load_checkpoint("job")
    assert cursor_of(mark, second) == us + 5_000_000, "its own entry does not hide the gap"
    assert cursor_of(mark, second + 1) == us + 9_000_000
    assert await store.record_runs([entry(first, "n1", us + 10_000_000)]) is not None
    assert cursor_of((await store.load_checkpoint("job"))[2], second) == us + 5_000_000


async def test_ping(case: Case) -> None:
    await case.store.ping()


# Values this library never writes: it writes "<1..19 digits, within int64>|<owner id>".
FOREIGN_VALUES = {
    "empty": "",
    "no-separator": "garbage",
    "no-token": "|n1",
    "no-owner": "12|",
    "letters": "abc|n1",
    "zero": "0|n1",
    "negative": "-5|n1",
    "superscript-digit": "\u00b2|n1",
    "20-digits": "1" * 20 + "|n1",
    "above-int64": f"{2**63}|n1",
    "4301-digits": "9" * 4301 + "|n1",
    # ELECT answers a job as "<status> <ttl> <controls> <value>": the value, last, is whole
    "spaces": "12 | n1 1 1 1",
    "only-spaces": "   ",
    "line-break": "12|n1\n1 1 1",
}


@pytest.mark.parametrize("value", FOREIGN_VALUES.values(), ids=FOREIGN_VALUES.keys())
async def test_item3_a_foreign_lock_value_is_nobodys(case: Case, value: str) -> None:
    """No node renews, claims with or releases a lock value this library did not write, not
    even when it sends that very value as its own; the lock runs out and a term starts."""
    store, ttl_s = case.store, 5.0  # outlives the three calls on a busy machine
    case.set_lock("job", value, ttl_s)

    replies = [
        await elect_one(store, "n1", ttl_s=2.0),
        await elect_one(store, "n2", ttl_s=2.0, held=value),
        await elect_one(store, "n3", ttl_s=2.0, held=""),
    ]
    for reply in replies:
        assert not reply.held
        assert reply.value == value
        assert reply.token is None
        assert reply.ttl_s is not None and reply.ttl_s <= ttl_s + MS  # never extended
        assert reply.holder is not None and len(reply.holder) <= SHOWN_VALUE_CHARS + 1
    assert await store.claim("job", value, 1_000) == -1
    assert await store.release("n2", {"job": value}) == 0
    ttl_s = 0.4
    case.set_lock("job", value, ttl_s)  # and now let it run out

    taken: list[LeaseReply] = []

    async def acquired() -> bool:
        taken[:] = [await elect_one(store, "n1")]
        return taken[0].held

    await wait_until(acquired, ttl_s + 2.0, "a node acquires once the foreign lock ran out")
    assert taken[0].token is not None and taken[0].holder == "n1"


async def test_item3_a_long_foreign_value_is_shown_cut(case: Case) -> None:
    value = "x" * 5000
    case.set_lock("job", value, TTL_S)
    reply = await elect_one(case.store, "n1")
    assert reply.value == value
    assert reply.holder == "x" * SHOWN_VALUE_CHARS + "\u2026"


async def test_item11_an_instant_ahead_of_the_store_clock_is_not_claimed(case: Case) -> None:
    """A node whose wall clock runs a year ahead must not record its instant: that would make
    every node skip every instant for a year."""
    store = case.store
    token = await new_term(store, "n1")
    value = f"{token}|n1"
    now_us = int(datetime.now(UTC).timestamp() * 1_000_000)
    year_us = 365 * 24 * 3600 * 1_000_000

    assert await store.claim("job", value, now_us + year_us) == -2
    assert await store.claim("job", "1|someone-else", now_us + year_us) == -1, "holder first"
    assert await store.claim("job", value, now_us - 1_000_000) == 1, "nothing was recorded"
    assert await store.claim("job", value, now_us + 60_000_000) == -2
    assert await store.claim("job", value, now_us + 60_000_000, max_ahead_us=120_000_000) == 1
    assert await store.claim("job", value, now_us + 100_000) == 0, "the later one was recorded"


async def test_the_check_opens_a_spell_once_tells_it_once_and_ends_it(case: Case) -> None:
    store = case.store
    """Two nodes' checks on one store: the spell opens at the deadline, only if the anchor is
    still the one it was judged by; one caller takes the telling (a later one that can tell
    takes it when the opener could not); a claim changes the anchor and ends the spell."""
    first = await store.check_overdue([OverdueCheck("j", "", None)], retention_s=60)
    (state,) = first.jobs
    assert state.anchor.empty and state.spell is None and not state.opened
    now, anchor = first.now, state.anchor.text
    stale = await store.check_overdue([OverdueCheck("j", "9,,", now)], retention_s=60)
    assert stale.jobs[0].spell is None  # judged by another anchor: not opened
    future = now + timedelta(hours=1)
    early = await store.check_overdue([OverdueCheck("j", anchor, future)], retention_s=60)
    assert early.jobs[0].spell is None

    opened = await store.check_overdue([OverdueCheck("j", anchor, now)], retention_s=60)
    assert opened.jobs[0].opened and not opened.jobs[0].tell  # the opener cannot tell
    assert opened.jobs[0].spell is not None and opened.jobs[0].spell[0] == now
    teller = OverdueCheck("j", anchor, now, can_tell=True)
    replies = [await store.check_overdue([teller], retention_s=60) for _ in range(3)]
    assert [(r.jobs[0].opened, r.jobs[0].tell) for r in replies] == [
        (False, True),
        (False, False),
        (False, False),
    ]
    cluster = await store.read_cluster(["j"])
    assert cluster.jobs["j"].overdue_since == now

    [reply] = await store.elect("n#1", [LeaseRequest("j", 5.0)])
    assert reply.held and reply.value is not None
    await store.claim("j", reply.value, to_unix_us(now))
    (cluster_job,) = (await store.read_cluster(["j"])).jobs.values()
    assert cluster_job.overdue_since is None  # its anchor changed: over, even before a check
    ended = await store.check_overdue([teller], retention_s=60)
    assert ended.jobs[0].spell is None and ended.jobs[0].anchor.claimed_us == to_unix_us(now)
    assert not ended.jobs[0].opened

    moved = ended.jobs[0].anchor.text
    again = await store.check_overdue(
        [OverdueCheck("j", moved, now, can_tell=True)], retention_s=60
    )
    assert again.jobs[0].opened and again.jobs[0].tell  # a new spell: told again


async def test_a_pause_ends_the_spell_and_keeps_it_shut(case: Case) -> None:
    store = case.store
    first = await store.check_overdue([OverdueCheck("j", "", None)], retention_s=60)
    check = OverdueCheck("j", first.jobs[0].anchor.text, first.now, can_tell=True)
    assert (await store.check_overdue([check], retention_s=60)).jobs[0].opened
    await store.set_control("paused:j", '{"at": "2030-01-01T00:00:00+00:00", "by": "t"}')
    paused = await store.check_overdue([check], retention_s=60)
    assert paused.jobs[0].paused and paused.jobs[0].spell is None and not paused.jobs[0].opened
    await store.set_control("paused:j", None)
    resumed = await store.check_overdue([check], retention_s=60)
    assert resumed.jobs[0].opened  # the caller's deadline decides: the watch counts afresh


# --- Redis only --------------------------------------------------------------------------------


@pytest.fixture
async def store(unique_project: str, redis_url: str) -> AsyncIterator[RedisLeaseStore]:
    redis_store = RedisLeaseStore(unique_project, url=redis_url)
    try:
        yield redis_store
    finally:
        await redis_store.aclose()


@pytest.mark.redis
async def test_redis_keys_and_values(
    store: RedisLeaseStore, redis_server: RedisServer, unique_project: str
) -> None:
    reply = await elect_one(store, "node-a")
    lock = _keys.job_key(unique_project, "job", "lock")
    fence = _keys.job_key(unique_project, "job", "fence")

    with redis_server.client() as client:
        keys = set(client.scan_iter(match=f"singletonjob:{{{unique_project}}}:*"))
        assert keys == {lock, fence}
        assert lock == f"singletonjob:{{{unique_project}}}:job:lock"
        assert client.get(lock) == f"{reply.token}|node-a"
        assert client.get(fence) == str(reply.token)
        assert TTL_MS - 200 <= client.pttl(lock) <= TTL_MS
        assert client.pttl(fence) == -1  # the fence outlives every term
        assert client.type(lock) == "string"


@pytest.mark.redis
async def test_redis_script_flush_is_survived(
    store: RedisLeaseStore, redis_server: RedisServer
) -> None:
    first = await elect_one(store, "n1")
    with redis_server.client() as client:
        client.script_flush()
        renewed = await elect_one(
            store, "n1", held=first.value
        )  # NOSCRIPT, then the script is sent again
        assert renewed.held and renewed.token == first.token
        client.script_flush()
        assert renewed.value is not None
        assert await store.release("n1", {"job": renewed.value}) == 1
        assert (await elect_one(store, "n2")).held


@pytest.mark.redis
async def test_redis_tokens_keep_growing_after_data_loss(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    server = fresh_redis()
    store = RedisLeaseStore(unique_project, url=server.url)
    fence = _keys.job_key(unique_project, "job", "fence")
    try:
        tokens = [await new_term(store, "n1")]
        with server.client() as client:
            client.flushall()
            tokens.append(await new_term(store, "n2"))
        await asyncio.to_thread(server.restart)  # empty: no persistence
        tokens.append(await new_term(store, "n1"))
        with server.client() as client:
            # A fence ahead of the server clock (a clock that stepped back) still wins.
            ahead = 2 * int(client.get(fence) or 0)
            client.set(fence, ahead)
            client.delete(_keys.job_key(unique_project, "job", "lock"))
            tokens.append(await new_term(store, "n2"))
    finally:
        await store.aclose()

    assert tokens == sorted(set(tokens)), f"tokens must strictly grow: {tokens}"
    assert tokens[-1] == ahead + 1


@pytest.mark.redis
async def test_redis_one_round_trip_elects_all_jobs(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    server = fresh_redis()
    store = RedisLeaseStore(unique_project, url=server.url)
    requests = [LeaseRequest(f"job-{i}", TTL_S) for i in range(20)]
    # With a membership record and an operator's control: still that one call.
    record = MemberRecord("n1", "n1", "0", datetime.now(UTC), {"job-0": "every 1s"}, 1)
    store.announce(Membership(record))
    await store.set_control(_keys.control_field("paused", "job-3"), "{}")
    try:
        first = await store.elect("n1", requests)  # connects and loads the script
        renewals = [LeaseRequest(r.job, TTL_S, r.value) for r in first]
        with server.client() as client:
            before = _calls(client)
            replies = await store.elect("n1", renewals)
            after = _calls(client)
    finally:
        await store.aclose()

    assert all(reply.held for reply in replies)
    assert [reply.job for reply in replies if reply.paused] == ["job-3"]
    delta = {k[len("cmdstat_") :]: n - before.get(k, 0) for k, n in after.items()}
    assert delta.pop("evalsha") == 1
    # Everything else ran inside that one script call (TYPE: the keys it owns are checked).
    inside = {"get", "set", "pexpire", "pttl", "time", "hlen", "hgetall", "hexists", "hget"}
    assert {k for k, n in delta.items() if n} <= inside | {
        "zadd",
        "zrangebyscore",
        "hsetnx",
        "type",
    }


def _calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command so far, leaving out the INFO calls that read them."""
    stats = client.info("commandstats")
    return {k: int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info"}


@pytest.mark.redis
async def test_redis_key_sizes(
    store: RedisLeaseStore, redis_server: RedisServer, unique_project: str
) -> None:
    # A typical pod name as node id, and a typical job name.
    await store.elect("web-7d9f8c6b5-x2k4p-12345-ab12", [LeaseRequest("price-tick", TTL_S)])
    with redis_server.client() as client:
        lock_bytes = int(
            client.memory_usage(_keys.job_key(unique_project, "price-tick", "lock")) or 0
        )
        fence_bytes = int(
            client.memory_usage(_keys.job_key(unique_project, "price-tick", "fence")) or 0
        )

    print(f"MEMORY USAGE: lock key {lock_bytes} B, fence key {fence_bytes} B")
    assert 0 < lock_bytes <= LOCK_BYTES_MAX
    assert 0 < fence_bytes <= FENCE_BYTES_MAX


@pytest.mark.redis
@pytest.mark.parametrize("decode_responses", [False, True])
async def test_redis_user_client_is_used_and_left_open(
    redis_server: RedisServer, unique_project: str, decode_responses: bool
) -> None:
    name = f"{unique_project}-app"
    client = redis.asyncio.Redis.from_url(
        redis_server.url, decode_responses=decode_responses, client_name=name
    )

    async def connections() -> set[int]:
        """Ids of the server's connections with the user's settings (so, its name)."""
        return {int(c["id"]) for c in await client.client_list() if c["name"] == name}

    try:
        users = await client.client_id()
        store = RedisLeaseStore(unique_project, client=client)
        try:
            reply = await elect_one(store, "n1")
            assert reply.held and reply.value == f"{reply.token}|n1"
            assert await store.release("n1", {"job": reply.value}) == 1
            assert "client passed in" in repr(store)
            ours = await connections()
            assert users in ours and len(ours) >= 2  # the store has connections of its own
        finally:
            await store.aclose()

        # The store's connections are gone; the user's very connection is still open.
        async def only_users_left() -> bool:
            return await connections() == {users}

        await wait_until(only_users_left, 2.0, "only the user's connection is left")
        assert await client.client_id() == users
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_redis_url_with_password(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    server = fresh_redis()
    # servers.py's readiness probe has no password, so the password is set after startup.
    with server.client() as client:
        client.config_set("requirepass", "s3cret-pw")
    good = RedisLeaseStore(unique_project, url=f"redis://:s3cret-pw@127.0.0.1:{server.port}/0")
    bad = RedisLeaseStore(unique_project, url=f"redis://:wrong@127.0.0.1:{server.port}/0")
    anonymous = RedisLeaseStore(unique_project, url=server.url)
    try:
        assert (await elect_one(good, "n1")).held
        assert "s3cret-pw" not in repr(good)
        with pytest.raises(redis.AuthenticationError):
            await elect_one(bad, "n2")
        with pytest.raises(redis.AuthenticationError):
            await anonymous.ping()
    finally:
        for each in (good, bad, anonymous):
            await each.aclose()


@pytest.mark.redis
@pytest.mark.parametrize(("policy", "warns"), [("allkeys-lru", True), ("noeviction", False)])
async def test_an_evicting_policy_is_warned_about(
    fresh_redis: RedisServerFactory,
    unique_project: str,
    caplog: pytest.LogCaptureFixture,
    policy: str,
    warns: bool,
) -> None:
    server = fresh_redis(extra_args=["--maxmemory", "64mb", "--maxmemory-policy", policy])
    store = RedisLeaseStore(unique_project, url=server.url)
    try:
        with caplog.at_level(logging.WARNING, logger="fastapi_singletonjob"):
            await elect_one(store, "n1")
            await elect_one(store, "n1")
    finally:
        await store.aclose()
    warnings = [r for r in caplog.records if "may evict lock keys" in r.getMessage()]
    assert len(warnings) == (1 if warns else 0)
    if warns:
        assert policy in warnings[0].getMessage()


def test_a_notice_that_names_no_job_asks_about_every_job() -> None:
    assert parse_notice(b"jobs a b") == frozenset({"a", "b"})
    assert parse_notice("jobs ") == frozenset()
    assert parse_notice(b"control job-a") == frozenset({"job-a"})
    # An operator's control as an older version published it, and the count an even older
    # one did: every job.
    assert parse_notice(b"control") is None
    assert parse_notice(b"3") is None


@pytest.mark.redis
async def test_redis_listener_keepalive_rides_on_the_election_call(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    """A silent subscription is checked by an echo that the next ``ELECT`` publishes inside
    its script, which the listener hears and does not pass on: no ``PING`` of its own, so a
    round stays one round trip. With no ``ELECT`` call meanwhile, a ``PING`` checks it."""
    server = fresh_redis()
    store = RedisLeaseStore(unique_project, url=server.url)
    channel = _keys.release_channel(unique_project)
    keepalive_s = 0.5  # at 0.2 s a slow moment of a busy machine failed the listener
    heard: list[frozenset[str] | None] = []
    listener = asyncio.create_task(store.listen_releases(heard.append, keepalive_s=keepalive_s))
    try:
        with server.client() as client:

            def subscribed() -> bool:
                return bool(client.pubsub_numsub(channel)[0][1] == 1)

            await wait_until(subscribed, 5.0, "the listener subscribed")
            await store.elect("n1", [LeaseRequest("job", TTL_S)])  # loads the script
            before = _calls(client)
            for _ in range(int(6 * keepalive_s / 0.05)):  # an election round every 50 ms
                await store.elect("n1", [LeaseRequest("job", TTL_S)])
                await asyncio.sleep(0.05)
            electing = {k: n - before.get(k, 0) for k, n in _calls(client).items()}
            assert not listener.done(), listener
            idle_from = _calls(client)
            await asyncio.sleep(4 * keepalive_s)  # no election call: the listener PINGs
            idle = {k: n - idle_from.get(k, 0) for k, n in _calls(client).items()}
            assert not listener.done(), listener
            assert subscribed()
    finally:
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
        await store.aclose()

    assert electing.get("cmdstat_ping", 0) == 0, electing
    assert electing.get("cmdstat_publish", 0) >= 2, "echoes published by the ELECT script"
    assert heard == [], "an echo is no release notice"
    assert idle.get("cmdstat_ping", 0) >= 1, idle


async def test_read_members_gives_the_stored_records_of_the_owners_asked_for(
    case: Case,
) -> None:
    """``read_members`` (how a node compares its job definitions with a member's whose digest
    differs): the records stored, by owner id; an owner without one is left out."""
    store = case.store
    assert await store.read_members(["n1#1"]) == {}
    record = MemberRecord("n1", "n1#1", "0", NOW, {"cleanup": "interval every 2s"}, 5)
    store.announce(Membership(record))
    await store.elect("n1#1", [LeaseRequest("cleanup", TTL_S)])
    assert await store.read_members(["nobody#0", "n1#1"]) == {"n1#1": record}
    assert await store.read_members([]) == {}
