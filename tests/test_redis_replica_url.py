"""An operator error: ``redis_url`` points at a replica. The node starts and serves, nobody
runs the job through it, and readiness says why, with the fix; liveness stays ok (a restart
would not help). Both the plain URL and a Sentinel-managed client are covered by the store's
check of the server's role (tests/test_store_defects.py, item 10); this is what an operator
sees."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from servers import HOST, RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob import SingletonJobs

pytestmark = pytest.mark.redis

PREFIX = "/singletonjob"
PRIMARY_ARGS = ("--repl-diskless-sync-delay", "0")


async def test_a_url_of_a_replica_is_reported_by_readiness_with_the_fix(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    primary = fresh_redis(extra_args=PRIMARY_ARGS)
    replica = fresh_redis(extra_args=["--replicaof", HOST, str(primary.port)])
    replica.wait_replica_synced()
    jobs = SingletonJobs(
        replica.url,
        project=unique_project,
        heartbeat_interval=0.1,
        lock_expiry=0.5,
        max_backoff=0.3,
        shutdown_timeout=1.0,
    )
    runs: list[str] = []

    @jobs.interval("tick", every=0.05)
    async def tick() -> None:
        runs.append("run")

    app = FastAPI(lifespan=jobs.lifespan)
    app.include_router(jobs.router, prefix=PREFIX)
    reasons: list[str] = []
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://node") as client,
    ):

        async def reports_the_replica() -> bool:
            response = await client.get(f"{PREFIX}/health/jobs")
            assert response.status_code == 503, response.text
            reasons.append(response.json()["reason"])
            return "replica" in reasons[-1]

        await wait_until(reports_the_replica, 5.0, f"readiness names the replica: {reasons}")
        live = await client.get(f"{PREFIX}/health/live")
        node = (await client.get(f"{PREFIX}/jobs")).json()
    reason = reasons[-1]
    assert reason.startswith("the lease store has not answered yet (StoreReadOnly: "), reason
    assert f"{HOST}:{replica.port}" in reason and "point redis_url at the primary" in reason
    assert live.status_code == 200, "not a liveness failure: the node is fine, its URL is not"
    assert node["store"]["reachable"] is False and "replica" in node["store"]["error"]
    assert runs == [], "not a silent runner on a replica"
    with primary.client() as admin:
        assert admin.keys(f"*{unique_project}*") == [], "nothing written anywhere"
