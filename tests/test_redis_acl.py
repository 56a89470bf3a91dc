"""The minimal ACL documented in docs/redis.md, applied to a real server, on database 0 and on
database 1: every part of the library works under it (election, release and its notice,
claims), and the server logs no refused command."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
from servers import RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob import SingletonJobs

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret-acl"


def documented_acl(project: str) -> list[str]:
    """The ``ACL SETUSER`` rule set of docs/redis.md, for ``project``, as command arguments."""
    page = (ROOT / "docs" / "redis.md").read_text(encoding="utf-8")
    found = re.search(r"^ACL SETUSER (myapp-jobs .*)$", page, re.MULTILINE)
    assert found is not None, "docs/redis.md has no ACL SETUSER line"
    line = found.group(1).replace("myapp", project).replace("CHANGE-ME", PASSWORD)
    return line.split()


@pytest.mark.parametrize("db", [0, 1])
async def test_item12_the_documented_acl_serves_every_call(
    fresh_redis: RedisServerFactory, db: int
) -> None:
    server = fresh_redis()
    project = "acl"
    with server.client() as admin:
        admin.execute_command("ACL", "SETUSER", *documented_acl(project))
    url = f"redis://{project}-jobs:{PASSWORD}@127.0.0.1:{server.port}/{db}"
    runs: list[str] = []

    def node(name: str) -> SingletonJobs:
        jobs = SingletonJobs(
            url, project=project, node_id=name, heartbeat_interval=0.1, lock_expiry=0.5
        )

        @jobs.cron("every-second", "* * * * * *")  # claims each instant
        async def every_second() -> None:
            runs.append(name)

        return jobs

    a, b = node("a"), node("b")
    async with a, b:
        await wait_until(lambda: "a" in runs or "b" in runs, 5.0, "a first run")
        leader, follower = (a, b) if a.status().jobs[0].is_leader else (b, a)
        for jobs in (a, b):
            store = jobs.status().store
            assert store.reachable and store.error is None, store
        stopped_at = time.monotonic()
        await leader.stop()  # RELEASE deletes the lock and publishes the notice
        await wait_until(lambda: follower.status().jobs[0].is_leader, 2.0, "the follower leads")
        # Pushed by the notice, not found by polling a lock that would expire in 0.5 s.
        assert time.monotonic() - stopped_at < 0.4
        count = len(runs)
        await wait_until(lambda: len(runs) > count, 3.0, "a run on the new leader")
        assert follower.status().store.error is None
        # The operators' calls and the cluster view, under the same rules.
        await leader.pause("every-second")
        await wait_until(lambda: follower.status().jobs[0].paused, 2.0, "paused")
        # An instant not run goes to the history (RECORD_RUN's missed entry and the mark).
        for _ in range(40):
            entries = await follower.history("every-second")
            if any(entry.reason == "paused" for entry in entries):
                break
            await asyncio.sleep(0.1)
        assert any(entry.reason == "paused" for entry in entries), entries
        await leader.resume("every-second")
        await follower.trigger("every-second")
        await follower.step_down("every-second")
        view = await leader.cluster_status()
        assert [n.node_id for n in view.nodes] == [follower.node_id]
    with server.client() as admin:
        assert admin.execute_command("ACL", "LOG") == [], "no command was refused"
