"""Row 1: three healthy replicas, three jobs (fixed rate, interval, cron); nothing is faulted.

The yardstick for every other row: exactly one runner per job, each scheduled instant run at
most once, every instant that was not run accounted for by the leader's own drop counters,
one term per job, and the witness agreeing (no lost update, no rejected write).
"""

from __future__ import annotations

import pytest

from .checker import duplicates, max_concurrent, missed_instants
from .harness import FULL, Cluster, Results
from .replica import JobConfig

BASELINE_S = 60.0 if FULL else 4.0
JOBS = [
    JobConfig("rate", kind="rate", every=0.1, run_s=0.03),
    JobConfig("interval", kind="interval", every=0.1, run_s=0.03),
    JobConfig("cron", kind="cron", expression="* * * * * *", run_s=0.05),
]


@pytest.mark.timeout(BASELINE_S + 90)
async def test_row01_baseline(cluster: Cluster, record: Results) -> None:
    cluster.redis()
    nodes = [cluster.replica(f"n{i}", JOBS) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    for job in JOBS:
        await cluster.one_leader(job.name)
    await cluster.sleep(BASELINE_S)
    for node in nodes:
        node.terminate()
    for node in nodes:
        assert await node.wait_exit() == 0, cluster.describe()

    events = cluster.events()
    drops = {
        job.name: sum(
            sum(e.data["dropped"].values()) for e in events if e.ev == "stats" and e.job == job.name
        )
        for job in JOBS
    }
    report: dict[str, object] = {}
    for job in JOBS:
        runs = cluster.runs(job.name)
        terms = cluster.terms(job.name)
        done = sum(r.outcome == "ok" for r in runs)
        accepted, rejected = cluster.witness_fence(job.name)
        assert max_concurrent(runs) == 1, runs
        assert len(terms) == 1, terms  # no flapping
        assert cluster.witness_counter(job.name) == done  # no lost update
        assert rejected == 0
        assert all(r.outcome == "ok" for r in runs), [r for r in runs if r.outcome != "ok"]
        missed: list[float] = []
        if job.kind != "interval":
            assert duplicates(runs) == {}
            every = job.every if job.kind == "rate" else 1.0
            missed = missed_instants(runs, every, runs[0].scheduled, runs[-1].scheduled)
            # Every instant that did not run was dropped by the leader, and counted.
            assert len(missed) <= drops[job.name], (missed, drops)
        report[f"{job.name}_runs"] = len(runs)
        report[f"{job.name}_missed"] = len(missed)
    record.add("1", "baseline", seconds=BASELINE_S, transitions=0, max_concurrent=1, **report)
