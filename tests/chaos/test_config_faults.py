"""Rows 31, 34, 36, 37 and 38: wrong credentials, Redis Cluster, bad configuration and names.

Misconfiguration must fail early and loudly (at construction or registration, with no Redis
traffic), or, for credentials only Redis can check, keep failing slowly and visibly: no run,
no hot loop, a WARNING naming the error, a readiness probe that says why.
"""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import RedisCluster

from fastapi_singletonjob import ConfigurationError, SingletonJobs

from .checker import max_concurrent
from .harness import Cluster, Results, Timing, full_only, now
from .replica import JobConfig

JOB = "tick"
TICK = JobConfig(JOB, kind="rate", every=0.1, run_s=0.02)


def max_attempts(t: Timing, window_s: float) -> int:
    """The most election rounds the backoff allows in ``window_s`` seconds of failures:
    round ``f`` waits at least ``min(max_backoff, heartbeat * 2**f) / 2`` after the last."""
    elapsed, attempts = 0.0, 1
    while True:
        delay = min(t.max_backoff, t.heartbeat * 2.0**attempts) / 2
        if elapsed + delay > window_s:
            return attempts
        elapsed += delay
        attempts += 1


async def rejected_credentials(
    cluster: Cluster, record: Results, name: str, *, username: str | None, password: str
) -> None:
    t = cluster.timing
    node = cluster.replica("n1", [TICK], http=True, username=username, password=password)
    await cluster.ready(node)
    window_s = 3.0
    began = now()
    await cluster.sleep(window_s)
    fails = [e for e in node.events() if e.ev == "fail" and began <= e.t <= began + window_s]
    ready = await cluster.get(node, "/sj/health/jobs")
    first_warning = next(  # a refusal is no outage: said at ERROR, with the fix
        (line for line in node.output().splitlines() if "Redis refused the election" in line),
        "",
    )
    record.add(
        "31",
        name,
        attempts_in_3s=len(fails),
        allowed=max_attempts(t, window_s),
        health=ready.status_code if ready else None,
        warning=first_warning.split(": ", 1)[-1][:80],
    )
    assert cluster.runs(JOB) == []
    assert len(fails) <= max_attempts(t, window_s)  # backs off: no hot loop
    assert "ERROR" in first_warning and "No retry mends this" in first_warning
    assert ready is not None and ready.status_code == 503
    assert "refuses this node" in ready.json()["reason"]


async def test_row31_wrong_password(cluster: Cluster, record: Results) -> None:
    cluster.redis(extra_args=("--requirepass", "right"))
    await rejected_credentials(cluster, record, "wrong-password", username=None, password="x")
    assert cluster.log_has("AuthenticationError")


@full_only
async def test_row31_acl_noperm(cluster: Cluster, record: Results) -> None:
    store = cluster.redis()
    with store.client() as client:
        client.acl_setuser(
            "app", enabled=True, passwords=["+pw"], keys=["other:*"], commands=["+@all"]
        )
    await rejected_credentials(cluster, record, "acl-noperm", username="app", password="pw")
    assert cluster.log_has("NoPermissionError")


def test_row34_redis_cluster_client_is_accepted() -> None:
    # Redis Cluster is supported (docs/redis.md): a cluster client is taken as it is, without
    # any traffic before startup; one given a single Redis (or the reverse) is reported by
    # readiness (tests/test_redis_cluster.py), and rows 54-55b fail a real cluster over.
    client: Any = RedisCluster(host="127.0.0.1", port=1)
    jobs = SingletonJobs(redis=client, project="p")
    assert jobs.store_description == "<redis client passed in>"


BAD_SETTINGS: list[dict[str, Any]] = [
    {"heartbeat_interval": 0},
    {"heartbeat_interval": float("nan")},
    {"lock_expiry": 1.0, "heartbeat_interval": 2.0},
    {"max_backoff": 0.1, "heartbeat_interval": 1.0},
    {"project": "bad project"},
    {"project": "{p}"},
    {"shutdown_timeout": -1},
]


async def test_row36_bad_settings_fail_without_redis_traffic(
    cluster: Cluster, record: Results
) -> None:
    store = cluster.redis()
    with store.client() as client:
        before = int(client.info("stats")["total_connections_received"])
        failures = 0
        for bad in BAD_SETTINGS:
            settings: dict[str, Any] = {"project": "p", **bad}
            with pytest.raises(ConfigurationError):
                SingletonJobs(store.url, **settings)
            failures += 1
        after = int(client.info("stats")["total_connections_received"])
    record.add("36", "bad-settings", rejected=failures, connections=after - before)
    assert after == before  # the probe's own connection was already open


@pytest.mark.parametrize(
    ("expression", "timezone"),
    [
        ("61 * * * *", "UTC"),
        ("* * * *", "UTC"),
        ("*/0 * * * *", "UTC"),
        ("0 0 31 2 *", "UTC"),
        ("0 3 * * *", "Mars/Olympus"),
    ],
)
def test_row38_invalid_cron_fails_at_registration(expression: str, timezone: str) -> None:
    jobs = SingletonJobs("redis://127.0.0.1:1/0", project="p")
    with pytest.raises(ConfigurationError):
        jobs.cron("nightly", expression, timezone=timezone)(lambda: None)


def test_row37_duplicate_job_name_in_one_app() -> None:
    jobs = SingletonJobs("redis://127.0.0.1:1/0", project="p")
    jobs.fixed_rate("x", every=1)(lambda: None)
    with pytest.raises(ConfigurationError, match="already registered"):
        jobs.interval("x", every=1)(lambda: None)


async def test_row37_two_apps_share_a_project(cluster: Cluster, record: Results) -> None:
    # Two different services both define a job "tick" in one project: one lock, so one of
    # them never runs its own code, and nothing says so (known limit).
    cluster.redis()
    a = cluster.replica("appA", [TICK])
    await cluster.ready(a)
    await cluster.wait_leader(JOB)
    b = cluster.replica("appB", [JobConfig(JOB, kind="interval", every=0.3, run_s=0.1)])
    await cluster.ready(b)
    await cluster.sleep(2.0)
    runs = cluster.runs(JOB)
    record.add(
        "37",
        "two-apps-one-project",
        runs_app_a=sum(r.node == "appA" for r in runs),
        runs_app_b=sum(r.node == "appB" for r in runs),
        warned=cluster.log_has("fingerprint"),
    )
    assert max_concurrent(runs) == 1
    assert {r.node for r in runs} == {"appA"}  # app B's job starves
