"""Rows 43-48: the fault kinds of the adversarial review (issue 11), on real processes.

Each row is a defect the review found (its item number in brackets) turned into a fault that
the chaos suite injects into real replicas and a real redis-server:

- 43 [3] a foreign value written into a job's lock key by another program;
- 44 [5] a burst: 40 per-second cron jobs whose instants all fall on the same second; 44b
  the same behind a round trip of one heartbeat (it found that the election queued behind
  the claims in one shared pool: the election now has connections of its own; the claims
  themselves still time out there: open, strict ``xfail``, full matrix only);
- 45 [9] a half-open release listener (its pub/sub connection silently dead), then a
  graceful handover;
- 46 [10] one node pointed at a read-only replica of the store;
- 47 [11] a node whose wall clock is far ahead (libfaketime) leads a cron job;
- 48 [1] a term that starts from a reply arriving just before the lease deadline, with
  ``on_leadership_lost="cancel"``.

Settings are the CI defaults (heartbeat H = 0.1 s, lock expiry T = 0.5 s) except in row 48,
which needs a heartbeat long against the lease margin (see there). Every row asserts what the
defect broke; rows 45 and 48 were checked to fail with the old code patched into the replicas.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import redis

from fastapi_singletonjob._store import keys as _keys

from .checker import Run, duplicates, max_concurrent, missed_instants
from .harness import (
    FULL,
    TOL_S,
    Cluster,
    Replica,
    Results,
    Timing,
    full_only,
    needs_faketime,
    now,
    reps,
)
from .replica import JobConfig

JOB = "tick"
EVERY_S = 0.1
RUN_S = 0.03
TICK = JobConfig(JOB, kind="rate", every=EVERY_S, run_s=RUN_S)
OTHER = JobConfig("other", kind="rate", every=EVERY_S, run_s=RUN_S)
CRON = JobConfig("cron", kind="cron", expression="* * * * * *", run_s=0.02)


def raw_client(cluster: Cluster) -> redis.Redis:
    """A client of the store that returns bytes (a lock value need not be UTF-8)."""
    assert cluster.store is not None
    return cluster.store.client(decode_responses=False)


def wall_offset() -> float:
    """Add to a journal time (``CLOCK_MONOTONIC``) to get real Unix time."""
    return time.time() - now()


def stats_of(replica: Replica) -> list[dict[str, Any]]:
    """The per-job counters a replica journaled when it stopped gracefully."""
    return [dict(e.data) for e in replica.events() if e.ev == "stats"]


async def event_time(
    cluster: Cluster, ev: str, node: str | None, *, after: float, job: str | None = None
) -> float:
    """Wait (bounded) for the first ``ev`` event of ``node`` (of ``job``, if given) after
    ``after``; return its time."""

    def found() -> float | None:
        return next(
            (
                e.t
                for e in cluster.events()
                if e.ev == ev and e.node == node and e.t > after and job in (None, e.job)
            ),
            None,
        )

    await cluster.wait(lambda: found() is not None, 10, f"{ev} of {node} after {after:.3f}")
    at = found()
    assert at is not None
    return at


def started_between(runs: Sequence[Run], start: float, end: float) -> list[Run]:
    """The runs that started in ``(start, end]`` (journal clock)."""
    return [run for run in runs if start < run.start <= end]


# -- row 43: foreign lock values --------------------------------------------------------------

FOREIGN: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("garbage", b"not a lock value"),
    ("5000-digit token", b"7" * 5000 + b"|intruder#00000000"),
    ("non-UTF-8", b"\xff\xfe\x80 lock \xc3("),
]
HOLD_S = 1.0
"""How long a foreign value stands before it is deleted: two lock expiries."""
FOREIGN_TTL_MS = 800


async def probe_all(cluster: Cluster) -> dict[str, Any]:
    """GET the probes and the job list of every (uvicorn) replica; return what they said."""
    seen: dict[str, Any] = {"live": [], "ready": [], "leads_tick": [], "holder_chars": []}
    for replica in cluster.replicas.values():
        live = await cluster.get(replica, "/sj/health/live")
        ready = await cluster.get(replica, "/sj/health/jobs")
        jobs = await cluster.get(replica, "/sj/jobs")
        seen["live"].append(None if live is None else live.status_code)
        seen["ready"].append(None if ready is None else ready.status_code)
        assert jobs is not None and jobs.status_code == 200, jobs
        tick = next(j for j in jobs.json()["jobs"] if j["name"] == JOB)
        seen["leads_tick"].append(tick["is_leader"])
        seen["holder_chars"].append(len(tick["leader"] or ""))
    return seen


async def test_row43_foreign_lock_values(cluster: Cluster, record: Results) -> None:
    # Another program writes into the lock key of "tick": no node may take the value for its
    # own (item 3: "" was renewed by every node, three leaders with token 0), nothing may
    # fail for the node's other jobs (a non-UTF-8 value failed every round) or kill the
    # election (a 4,301-digit token did). Deleted, the lock is taken with a new token.
    t = cluster.timing
    cluster.redis()
    nodes = [cluster.replica(f"n{i}", [TICK, OTHER], http=True) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    await cluster.one_leader(JOB)
    await cluster.one_leader(OTHER.name)
    other_terms = len(cluster.terms(OTHER.name))
    lock = _keys.job_key(cluster.project, JOB, "lock")
    cases: list[tuple[str, bytes, int | None]] = [(k, v, None) for k, v in FOREIGN]
    cases.append(("garbage with a TTL", b"not a lock value", FOREIGN_TTL_MS))
    with raw_client(cluster) as client:
        for kind, value, ttl_ms in cases:
            old_token = max(term.token for term in cluster.terms(JOB))
            leader = cluster.leader(JOB)
            same_node = leader == cluster.leader(OTHER.name)
            fault_at = now()
            client.set(lock, value, px=ttl_ms)
            lost = await event_time(cluster, "lost", leader, after=fault_at, job=JOB)
            probes = await probe_all(cluster)
            if ttl_ms is None:
                await cluster.sleep(fault_at + HOLD_S - now())
                standing = client.get(lock) == value
                cleared_at = now()
                client.delete(lock)
            else:
                standing = client.get(lock) == value and int(client.pttl(lock)) > 0
                cleared_at = fault_at + ttl_ms / 1000  # expires on its own
            first = await cluster.first_run(JOB, after=fault_at, newer_than=old_token, timeout_s=5)
            events = cluster.events()
            leads = [e for e in events if e.ev == "lead" and e.job == JOB and fault_at < e.t]
            during = started_between(cluster.runs(JOB), lost, cleared_at)
            other_runs = started_between(cluster.runs(OTHER.name), fault_at, cleared_at)
            record.add(
                "43",
                f"foreign-{kind}",
                leader_stops_s=lost - fault_at,
                runs_while_standing=len(during),
                other_runs=len(other_runs),
                other_on_same_node=same_node,
                recovered_s=first.start - cleared_at,
                live=probes["live"],
                ready=probes["ready"],
                holder_chars=max(probes["holder_chars"]),
            )
            # Nobody counts the value as its own: the leader ends its term at its next round,
            # nobody starts one (no `lead`, no run) until the value is gone, and it stands.
            assert lost - fault_at <= t.heartbeat + TOL_S
            assert standing
            assert during == [], during
            assert all(lead.t >= cleared_at - 0.01 for lead in leads), leads
            assert probes["leads_tick"] == [False] * len(nodes)
            # The election is alive on every node and the node's other job goes on.
            assert probes["live"] == [200] * len(nodes)
            assert probes["ready"] == [200] * len(nodes)
            assert len(other_runs) >= (cleared_at - fault_at) / EVERY_S / 2
            # Gone (deleted, or expired), the lock is taken with a new, greater token.
            assert first.token > old_token
            assert first.start - cleared_at <= t.heartbeat + EVERY_S + TOL_S
    assert len(cluster.terms(OTHER.name)) == other_terms  # "other" never changed hands
    assert max_concurrent(cluster.runs(JOB)) == 1
    assert max_concurrent(cluster.runs(OTHER.name)) == 1
    assert not cluster.log_has("could not apply the store's reply")
    assert not cluster.log_has("Traceback")


# -- row 44: a burst of 40 cron jobs on one instant -------------------------------------------

BURST_JOBS = 40
BURST = [
    JobConfig(f"cron{i:02d}", kind="cron", expression="* * * * * *", run_s=0.01)
    for i in range(BURST_JOBS)
]


async def burst_row(
    cluster: Cluster,
    record: Results,
    row: str,
    name: str,
    *,
    watch_s: float,
    latency_s: float = 0.0,
    replicas: int = 3,
) -> dict[str, Any]:
    """``replicas`` replicas with the 40 per-second cron jobs (behind one proxy adding
    ``latency_s`` each way, if not 0); after a warm-up second, watch ``watch_s``, stop
    every replica gracefully and return (and record) what happened in the window."""
    cluster.redis()
    url = None
    if latency_s:
        proxy = await cluster.proxy()
        proxy.latency(latency_s)
        url = proxy.url
    nodes = [cluster.replica(f"n{i}", BURST, url=url) for i in range(1, replicas + 1)]
    await cluster.ready(*nodes)
    names = [job.name for job in BURST]
    await cluster.wait(
        lambda: all(cluster.terms(job) for job in names), 10, "every burst job has a leader"
    )
    # The instant a term began may be caught up, and the first burst opens the pool's
    # connections: watch from the second after.
    await cluster.sleep(1.5)
    start_at = now()
    await cluster.sleep(watch_s)
    end_at = now()
    offset = wall_offset()
    for node in nodes:
        node.terminate()
    for node in nodes:
        assert await node.wait_exit() == 0, cluster.describe()
    runs = {job: cluster.runs(job) for job in names}
    window = {job: started_between(rs, start_at, end_at) for job, rs in runs.items()}
    missed = {
        job: missed_instants(rs, 1.0, offset + start_at, offset + end_at - 0.5)
        for job, rs in runs.items()
    }
    doubled = {job: duplicates(rs) for job, rs in runs.items()}
    late_s = sorted(offset + r.start - r.scheduled for rs in window.values() for r in rs)
    dropped: dict[str, int] = {}
    for node in nodes:
        for stats in stats_of(node):
            for reason, count in stats["dropped"].items():
                dropped[reason] = dropped.get(reason, 0) + int(count)
    events = cluster.events()
    failed_rounds = [e for e in events if e.ev == "fail" and start_at < e.t <= end_at]
    transitions = [e for e in events if e.ev in ("lead", "lost") and start_at < e.t <= end_at]
    startup_losses = [e for e in events if e.ev == "lost" and e.t <= start_at]
    claim_warnings = sum("could not claim" in node.output() for node in nodes)
    found: dict[str, Any] = {
        "runs": sum(len(rs) for rs in window.values()),
        "seconds": round(end_at - start_at, 3),
        "leaders": sorted({term.node for job in names for term in cluster.terms(job)[-1:]}),
        "missed": sum(len(m) for m in missed.values()),
        "duplicates": sum(len(d) for d in doubled.values()),
        "dropped": {k: v for k, v in dropped.items() if v},
        "failed_rounds": len(failed_rounds),
        "transitions": len(transitions),
        "startup_losses": len(startup_losses),
        "nodes_warning_claims": claim_warnings,
        "start_after_instant_p50_s": late_s[len(late_s) // 2] if late_s else None,
        "start_after_instant_max_s": late_s[-1] if late_s else None,
    }
    record.add(row, name, **found)
    return found


@pytest.mark.parametrize("rep", reps(2))
async def test_row44_forty_cron_jobs_on_one_instant(
    cluster: Cluster, record: Results, rep: int
) -> None:
    # Item 5: with a 4-connection pool, 40 claims on one instant failed (170 of ~200 runs
    # dropped as store_error) and election rounds failed with them.
    found = await burst_row(
        cluster, record, "44", f"burst-{BURST_JOBS}-cron", watch_s=8.0 if FULL else 3.0
    )
    assert found["dropped"].get("store_error", 0) == 0, found
    assert found["missed"] == 0 and found["duplicates"] == 0, found
    assert found["failed_rounds"] == 0 and found["transitions"] == 0, found
    assert found["runs"] >= BURST_JOBS * (found["seconds"] - 1)
    assert found["start_after_instant_max_s"] <= 2 * TOL_S, found


@full_only
@pytest.mark.xfail(
    strict=True,
    reason="open: the election no longer queues behind claims (it has its own connections), "
    "but 40 claims of one instant behind a 0.1 s round trip still time out in the claims' "
    "pool (each new connection's handshake costs round trips) and instants are missed; the "
    "fix is one claim call per instant for all jobs, as ELECT does for renewals",
)
async def test_row44b_forty_cron_jobs_behind_latency(cluster: Cluster, record: Results) -> None:
    # As row 44, with every replica behind a link of half a heartbeat each way: a round trip
    # of one heartbeat, which the election alone rides out (row 11: twice that).
    t = cluster.timing
    found = await burst_row(
        cluster,
        record,
        "44b",
        f"burst-{BURST_JOBS}-cron-latency",
        watch_s=4.0 if FULL else 2.0,
        latency_s=t.heartbeat / 2,
        replicas=3 if FULL else 2,
    )
    assert found["transitions"] == 0, found
    assert found["missed"] == 0 and found["duplicates"] == 0, found
    assert found["dropped"].get("store_error", 0) == 0, found


# -- row 45: a half-open release listener ------------------------------------------------------


def subscribers(cluster: Cluster) -> int:
    """Subscriptions to the project's release channel, as the store counts them."""
    channel = _keys.release_channel(cluster.project)
    with raw_client(cluster) as client:
        counts = client.pubsub_numsub(channel)
    return int(counts[0][1]) if counts else 0


@pytest.mark.parametrize("rep", reps(3))
async def test_row45_half_open_release_listener(
    cluster: Cluster, record: Results, rep: int
) -> None:
    # Item 9: a pub/sub connection whose peer vanished without a RST heard nothing, for
    # good, so handovers fell back to polling. Here the follower's subscription goes silent
    # while its election connection works; its keepalive (a PING after one lock expiry of
    # silence, an answer due within another) must notice and subscribe again.
    t = cluster.timing
    cluster.redis()
    a = cluster.replica("a", [TICK])
    await cluster.ready(a)
    assert await cluster.wait_leader(JOB) == "a"
    proxy = await cluster.proxy()
    b = cluster.replica("b", [TICK], url=proxy.url)
    await cluster.ready(b)
    await cluster.wait(lambda: subscribers(cluster) == 2, 10, "a and b listen for releases")
    await cluster.until_runs(JOB, 3, since=now(), timeout_s=5)
    silenced_at = now()
    proxy.silence_subscribers()
    # The silent connection stays open at the store: a new subscription makes it three.
    resubscribed_at = await cluster.wait(
        lambda: subscribers(cluster) >= 3, 4 * t.lock_expiry + 5, "b subscribes again"
    )
    stop_at = a.terminate()
    assert await a.wait_exit() == 0
    # A tick of a's may start between the signal and its handling: the first run of a
    # newer term is b's.
    a_term = max(r.token for r in cluster.runs(JOB) if r.node == "a")
    first = await cluster.first_run(JOB, after=stop_at, newer_than=a_term, timeout_s=5)
    events = cluster.events()
    released = next(e for e in events if e.ev == "released" and e.node == "a" and e.t > stop_at)
    lead = next(e for e in events if e.ev == "lead" and e.node == "b" and e.t > stop_at)
    b_failures = [e for e in events if e.ev == "fail" and e.node == "b"]
    record.add(
        "45",
        "half-open-listener",
        resubscribed_after_s=resubscribed_at - silenced_at,
        handover_after_release_s=lead.t - released.t,
        handover_after_sigterm_s=lead.t - stop_at,
        first_run_after_sigterm_s=first.start - stop_at,
        b_failed_rounds=len(b_failures),
    )
    assert first.node == "b"
    # Within one keepalive (= lock expiry) of idle silence, one for the PING's answer, and a
    # reconnect delay (at most min(max_backoff, 2 H)).
    limit_s = 2 * t.lock_expiry + min(t.max_backoff, 2 * t.heartbeat) + TOL_S
    assert resubscribed_at - silenced_at <= limit_s
    assert b_failures == []  # the election's own connection never noticed anything
    assert lead.t - released.t <= t.heartbeat + TOL_S
    assert max_concurrent(cluster.runs(JOB)) == 1


# -- row 46: a node pointed at a read-only replica ---------------------------------------------


async def test_row46_node_on_a_read_only_replica(cluster: Cluster, record: Results) -> None:
    # Item 10: a node whose redis_url named a replica never led, and its probes stayed green.
    t = cluster.timing
    cluster.redis()
    replica = await cluster.read_replica()
    r = cluster.replica("r", [TICK], url=replica.url, http=True)
    nodes = [cluster.replica(f"n{i}", [TICK]) for i in (1, 2)]
    await cluster.ready(r, *nodes)
    await cluster.one_leader(JOB)
    watch_from = now()
    await cluster.sleep(1.0)
    ready = await cluster.get(r, "/sj/health/jobs")
    live = await cluster.get(r, "/sj/health/live")
    runs_meanwhile = started_between(cluster.runs(JOB), watch_from, now())
    # The others gone, the lock expires: still the node on the replica never leads.
    killed_at = max(n.kill() for n in nodes)
    await cluster.sleep(3 * t.lock_expiry)
    alone = await cluster.get(r, "/sj/health/jobs")
    attempts = [e for e in r.events() if e.ev == "fail"]
    refused = sum("StoreReadOnly" in line and "WARNING" in line for line in r.output().splitlines())
    assert ready is not None and live is not None and alone is not None
    reason = str(ready.json().get("reason"))
    record.add(
        "46",
        "replica-url",
        r_terms=sum(term.node == "r" for term in cluster.terms(JOB)),
        r_ready=ready.status_code,
        r_live=live.status_code,
        r_ready_alone=alone.status_code,
        reason=reason,
        r_failed_rounds=len(attempts),
        r_up_s=round(now() - r.events()[0].t, 1),
        others_runs_1s=len(runs_meanwhile),
        warnings=refused,
    )
    assert [term for term in cluster.terms(JOB) if term.node == "r"] == []
    assert ready.status_code == 503 and "replica" in reason, ready.json()
    assert live.status_code == 200, live.json()
    assert alone.status_code == 503 and "replica" in str(alone.json().get("reason"))
    assert [e for e in cluster.events() if e.ev == "fail" and e.node != "r"] == []
    assert len(runs_meanwhile) >= 5  # the others lead as usual
    assert [run for run in cluster.runs(JOB) if run.node == "r"] == []
    assert all(run.start <= killed_at for run in cluster.runs(JOB))
    assert refused >= 1  # the node says what is wrong
    assert max_concurrent(cluster.runs(JOB)) == 1


# -- row 47: a node whose wall clock is far ahead ----------------------------------------------

AHEAD_S = 60.0


@needs_faketime
async def test_row47_node_clock_far_ahead_leads_a_cron_job(
    cluster: Cluster, record: Results
) -> None:
    # Item 11: the claims of a node whose clock ran ahead were recorded, so every node then
    # skipped the instants up to the recorded one: the job was silenced cluster-wide for as
    # long as the clock was ahead. Now they are refused (clock_ahead) and nothing is recorded;
    # and (issue 26) a leader none of whose instants can run lets the job go after a lock
    # expiry: the node with the right clock runs it while f is still up.
    t = cluster.timing
    cluster.redis()
    f = cluster.replica("f", [CRON], clock_offset=AHEAD_S)
    await cluster.ready(f)
    assert await cluster.wait_leader(CRON.name) == "f"
    n1 = cluster.replica("n1", [CRON])
    await cluster.ready(n1)
    joined_at = now()
    first = await cluster.first_run(CRON.name, after=joined_at, newer_than=0, timeout_s=10)
    await cluster.until_runs(CRON.name, 3, since=first.start, timeout_s=10)
    last_key = _keys.job_key(cluster.project, CRON.name, "last")
    with raw_client(cluster) as client:
        recorded = client.get(last_key)
    checked_at_wall = time.time()
    stop_at = f.terminate()
    assert await f.wait_exit() == 0
    stats = stats_of(f)  # written as it exits
    runs = cluster.runs(CRON.name)
    after = [r for r in runs if r.start >= first.start]
    clock_ahead = sum(int(s["dropped"].get("clock_ahead", 0)) for s in stats)
    offset = wall_offset()
    recorded_us = int(recorded.split(b":")[0]) if recorded else None
    record.add(
        "47",
        f"clock+{AHEAD_S:g}s-cron",
        runs_by_f=len([r for r in runs if r.node == "f"]),
        refused_claims=clock_ahead,
        n1_first_run_after_join_s=first.start - joined_at,
        recorded_ahead_s=None if recorded_us is None else recorded_us / 1e6 - checked_at_wall,
        n1_runs=len(after),
        f_up_s=round(stop_at - joined_at, 3),
    )
    assert [r for r in runs if r.node == "f"] == []
    assert clock_ahead >= 1, stats
    assert cluster.log_has("is ahead of the store's clock", f)
    assert cluster.log_has("wall clock is ahead of Redis's", f)  # the let-go's cause
    # Nothing from the future was recorded...
    assert recorded_us is None or recorded_us / 1e6 <= checked_at_wall + 1.0
    # ...so the node with the right clock runs the instants once f lets the job go: within
    # a lock expiry of f's first refused claim, the next instant and a heartbeat.
    assert first.node == "n1"
    assert first.start - joined_at <= t.lock_expiry + 1.0 + 2 * t.heartbeat + 1.0 + TOL_S
    # From its second run on, every instant (its first may be a catch-up of the instant
    # before it took over, which can overlap the next instant: that one is then dropped).
    assert missed_instants(after, 1.0, after[1].scheduled, offset + after[-1].start) == []
    assert duplicates(runs) == {}


# -- row 48: a slow reply at term start, with on_leadership_lost="cancel" ----------------------

SLOW_TIMING = Timing(heartbeat=1.0, lock_expiry=3.0)
"""A heartbeat long against the lease margin (T - lease_s = 33 ms): the defect ended such a
term up to a heartbeat late, and with H = 0.1 s that lateness would mostly hide inside the
time the store's lock outlives the node's deadline."""
REQUEST_S = 0.02
"""Latency of the proxy each way; the store's lock then outlives the term by this more."""
TERM_S = 0.1
"""How long the term lasts between the slow reply and its deadline."""
# Without a checkpoint: the row is about the deadline of a term that starts from a slow reply,
# and a checkpoint's read at the term's first run would wait on the held requests.
SLOW = JobConfig(
    "slow", kind="interval", every=0.05, run_s=6.0, steps=60, policy="cancel", checkpoint=False
)


@pytest.mark.parametrize("rep", reps(3))
async def test_row48_slow_reply_at_term_start_cancel(
    cluster: Cluster, record: Results, rep: int
) -> None:
    # Item 1: a term that began from a slow reply, with its deadline nearer than the sleep the
    # deadline watchdog had begun, ended up to a heartbeat late: leadership_lost (and so the
    # "cancel" policy) came after the store's lock had expired and another node had started.
    #
    # Node p, behind the proxy, acquires the lock; its reply is delayed so that it arrives
    # TERM_S before p's lease deadline, and every request p sends after that is held, so p
    # cannot renew. Another node takes over when the store's lock expires, T after it was set.
    t = SLOW_TIMING
    reply_s = t.lease_s - 2 * REQUEST_S - TERM_S
    cluster.redis()
    others = [cluster.replica(name, [SLOW], timing=t) for name in ("b", "c")]
    await cluster.ready(*others)
    leader = cluster.replica_of(await cluster.wait_leader(SLOW.name))
    successor = next(node for node in others if node is not leader)
    proxy = await cluster.proxy()
    p = cluster.replica("p", [SLOW], url=proxy.url, timing=t)
    await cluster.ready(p)
    # p's election and release listener are connected, and its first rounds are done.
    await cluster.wait(lambda: proxy.connections >= 2, 10, "p is connected")
    await cluster.sleep(0.3)
    await cluster.mid_run(SLOW.name, leader.name)
    proxy.latency(REQUEST_S)
    await successor.pause()  # it must not win the race for the lock
    lock = _keys.job_key(cluster.project, SLOW.name, "lock")
    with raw_client(cluster) as client:
        killed_at = leader.kill()
        proxy.delay_replies(reply_s)
        client.delete(lock)  # free now, rather than when the killed leader's lock expires

        def held_by_p() -> bool:
            value = client.get(lock) or b""
            return b"|p#" in value

        await cluster.wait(held_by_p, 2 * t.lock_expiry + 5, "p acquires", poll_s=0.002)
        proxy.hold_requests()
        seen_at = now()
        ttl_ms = int(client.pttl(lock))
        client_value = client.get(lock)
    await successor.resume()
    set_at = seen_at - (t.lock_expiry - ttl_ms / 1000)
    deadline = set_at - REQUEST_S + t.lease_s  # p sent its request REQUEST_S before
    p_token = int((client_value or b"0").split(b"|")[0])
    successor_run = await cluster.first_run(
        SLOW.name, after=set_at, newer_than=p_token, timeout_s=15
    )
    assert successor_run.node == successor.name, successor_run
    proxy.pass_through()
    term = await event_time(cluster, "lead", "p", after=killed_at, job=SLOW.name)
    lost = await event_time(cluster, "lost", "p", after=term, job=SLOW.name)
    runs = cluster.runs(SLOW.name)
    p_runs = [r for r in runs if r.node == "p"]
    record.add(
        "48",
        "slow-reply-term-start-cancel",
        reply_delay_s=reply_s,
        term_s=deadline - term,
        lost_after_deadline_s=lost - deadline,
        cancelled_after_deadline_s=[r.ended_by(0.0) - deadline for r in p_runs],
        outcomes=[r.outcome for r in p_runs],
        successor_run_after_set_s=successor_run.start - set_at,
        margin_s=successor_run.start - max((r.ended_by(0.0) for r in p_runs), default=deadline),
        max_concurrent=max_concurrent(runs),
    )
    assert len(p_runs) == 1, p_runs  # the term started, and its run with it
    run = p_runs[0]
    assert run.outcome == "cancelled"
    # At the deadline (scheduling slack of a busy machine), not up to a heartbeat later.
    assert lost - deadline <= 0.1
    assert run.ended_by(0.0) - deadline <= 0.1
    assert max_concurrent(runs) == 1
    assert (
        t.lock_expiry - 0.05 <= successor_run.start - set_at <= t.lock_expiry + t.heartbeat + TOL_S
    )
