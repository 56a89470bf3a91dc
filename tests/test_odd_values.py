"""Values in Redis that the library did not expect, on a real redis-server: whatever a shared key
holds, the election goes on (issue 26)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from servers import RedisServer

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
