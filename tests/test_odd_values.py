"""Values in Redis that the library did not expect, on a real redis-server: whatever a shared key
holds, the election goes on (issue 26)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from servers import RedisServer

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._store import keys as _keys
from fastapi_singletonjob._store.base import LeaseRequest
from fastapi_singletonjob._store.membership import MemberRecord, Membership
from fastapi_singletonjob._store.redis.store import RedisLeaseStore

pytestmark = pytest.mark.redis

TTL_S = 5.0


async def test_elect_drops_any_number_of_expired_membership_records(
    redis_server: RedisServer, redis_url: str, unique_project: str
) -> None:
    """9,000 records expiring together (a fleet that reconnects after an outage) are all
    dropped by the next ``ELECT``, which still answers: Lua's ``unpack`` takes about 8,000
    values at most, and one call of it failed every round of every node, for good."""
    expired = 9_000
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    with redis_server.client() as client:
        pipe = client.pipeline(transaction=False)
        for i in range(expired):
            owner = f"web-{i}#{i:08x}"
            pipe.hset(_keys.project_key(unique_project, "nodes"), owner, "{}")
            pipe.zadd(_keys.project_key(unique_project, "nodes:expiry"), {owner: now_ms - 1000})
            pipe.hset(
                _keys.project_key(unique_project, "nodes:placement"),
                owner,
                f"{now_ms - 60_000}|0123456789abcdef",
            )
        pipe.execute()
    store = RedisLeaseStore(unique_project, url=redis_url)
    record = MemberRecord("n1", "n1#00", "0", datetime.now(UTC), {"job": "every 1s"}, TTL_S)
    store.announce(Membership(record))
    try:
        replies = await store.elect("n1#00", [LeaseRequest("job", TTL_S)])
    finally:
        await store.aclose()
    assert [reply.held for reply in replies] == [True]
    with redis_server.client() as client:
        assert client.zcard(_keys.project_key(unique_project, "nodes:expiry")) == 1
        assert client.hlen(_keys.project_key(unique_project, "nodes")) == 1
        placement = client.hkeys(_keys.project_key(unique_project, "nodes:placement"))
        assert sorted(placement) == ["#epoch", "n1#00"]


ODD_NUMBERS = {
    "superscript-two": "\u00b2",  # str.isdigit() accepts it, int() refuses it
    "arabic-indic": "\u0661\u0662",  # int() reads it, but no script writes it
    "4301-digits": "9" * 4301,  # past int()'s default limit of digits
    "25-digits": "9" * 25,  # past year 9999 as µs
    "text": "soon",
}


@pytest.mark.parametrize("odd", ODD_NUMBERS.values(), ids=ODD_NUMBERS.keys())
async def test_an_odd_placement_entry_is_left_out_and_the_election_goes_on(
    redis_server: RedisServer,
    redis_url: str,
    unique_project: str,
    odd: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A field of ``nodes:placement`` that no node wrote (another tool, a hand, a future
    version) is left out of placement and logged once; before, its ``int()`` raised in every
    node's round, for good, and readiness blamed Redis."""
    placement = _keys.project_key(unique_project, "nodes:placement")
    with redis_server.client() as client:
        client.hset(placement, "other#00000000", f"{odd}|0123456789abcdef")
    store = RedisLeaseStore(unique_project, url=redis_url)
    record = MemberRecord("n1", "n1#00", "0", datetime.now(UTC), {"job": "every 1s"}, TTL_S)
    membership = Membership(record)
    store.announce(membership)
    try:
        first = await store.elect("n1#00", [LeaseRequest("job", TTL_S)])
        with redis_server.client() as client:
            client.hincrby(placement, "#epoch", 1)  # the placement is read again
        second = await store.elect("n1#00", [LeaseRequest("job", TTL_S, first[0].value)])
    finally:
        await store.aclose()
    assert first[0].held and second[0].held
    assert set(membership.peers) == {"n1#00"}
    warnings = [r for r in caplog.records if "other#00000000" in r.getMessage()]
    assert len(warnings) == 1, "logged once"


@pytest.mark.parametrize("odd", ODD_NUMBERS.values(), ids=ODD_NUMBERS.keys())
async def test_an_odd_last_key_reads_as_no_instant_in_the_cluster_view(
    redis_server: RedisServer, redis_url: str, unique_project: str, odd: str
) -> None:
    """A job's ``last`` key holding something no script wrote reads as no last instant: the
    cluster view (``GET /cluster``, ``singletonjob status``, ``pause``) still answers; before,
    it raised ``ValueError`` or ``OverflowError`` for every job."""
    with redis_server.client() as client:
        client.set(_keys.job_key(unique_project, "tick", "last"), f"{odd}:7")
        client.set(_keys.job_key(unique_project, "ok", "last"), "1700000000000000:7")
    jobs = SingletonJobs(redis_url, project=unique_project)

    @jobs.fixed_rate("tick", every=1.0)
    async def tick() -> None:
        pass

    jobs.fixed_rate("ok", every=1.0)(tick)
    view = await jobs.cluster_status()
    shown = {job.name: job.last_instant for job in view.jobs}
    assert shown["tick"] is None
    assert shown["ok"] == datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)
    await jobs.pause("tick")  # finds the job through the same read
