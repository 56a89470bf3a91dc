"""Rows 13-17 and 19-22: the Redis server stalls, restarts, or loses the lock key.

The store is a dedicated redis-server (``fresh_redis``); the witness is another one that is
never touched. A lost key (DEL, FLUSHALL, an early expiry, eviction, a restart without
persistence) lets a second node acquire while the old leader still counts itself leader: the
overlap is bounded by the old leader's next round (about one heartbeat), and fenced writes of
the stale term are rejected. Those rows are known limits with a measured bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import redis

from fastapi_singletonjob._store import keys as _keys

from .checker import (
    duplicates,
    first_accepted,
    max_concurrent,
    overlap_s,
    stale_writes,
    writes_sent_after,
)
from .harness import TOL_S, Cluster, Results, Timing, full_only, now, reps
from .replica import JobConfig

JOB = "tick"
EVERY_S = 0.1
RUN_S = 0.03
TICK = JobConfig(JOB, kind="rate", every=EVERY_S, run_s=RUN_S)


async def three_replicas(
    cluster: Cluster,
    *,
    timing: Timing | None = None,
    appendonly: bool = False,
    extra_args: tuple[str, ...] = (),
) -> str:
    """The store and three replicas; return the leader's node id once it runs."""
    cluster.redis(appendonly=appendonly, extra_args=extra_args)
    nodes = [cluster.replica(f"n{i}", [TICK], timing=timing) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    return await cluster.one_leader(JOB)


def store_client(cluster: Cluster) -> redis.Redis:
    """A client of the faulted store."""
    assert cluster.store is not None
    return cluster.store.client()


@pytest.mark.parametrize("rep", reps(3))
async def test_row13_redis_stalled_for_two_lease_times(
    cluster: Cluster, record: Results, rep: int
) -> None:
    t = cluster.timing
    await three_replicas(cluster)
    store = cluster.store
    assert store is not None
    old_token = cluster.runs(JOB)[-1].token
    paused_at = now()
    await asyncio.to_thread(store.pause)
    try:
        await cluster.sleep(paused_at + 2 * t.lock_expiry - now())
    finally:
        await asyncio.to_thread(store.resume)
    resumed_at = now()
    first = await cluster.first_run(JOB, after=resumed_at, newer_than=old_token, timeout_s=10)
    await cluster.until_runs(JOB, 10, since=first.start, timeout_s=5)
    runs = cluster.runs(JOB)
    last_old = max(r.start for r in runs if r.token == old_token)
    during = [r for r in runs if paused_at + t.lease_s + 0.02 < r.start < resumed_at]
    winners = [term for term in cluster.terms(JOB) if term.t > resumed_at]
    record.add(
        "13",
        "redis-sigstop-2T",
        last_old_start_s=last_old - paused_at,
        leader_after_resume_s=first.start - resumed_at,
        winners=len(winners),
    )
    assert last_old <= paused_at + t.lease_s + 0.02
    assert during == []
    assert len(winners) == 1, winners  # exactly one winner when Redis comes back
    assert max_concurrent(runs) == 1
    # Every node failed rounds meanwhile and backs off: up to max_backoff, then one round.
    assert first.start - resumed_at <= t.max_backoff + t.heartbeat + EVERY_S + TOL_S


@pytest.mark.parametrize("rep", reps(5))
async def test_row14_redis_restarted_empty(cluster: Cluster, record: Results, rep: int) -> None:
    t = cluster.timing
    await three_replicas(cluster)
    store = cluster.store
    assert store is not None
    old_token = cluster.runs(JOB)[-1].token
    restart_at = now()
    await asyncio.to_thread(store.restart)  # SIGTERM (no save configured), same port, empty
    restarted_at = now()
    first = await cluster.first_run(JOB, after=restart_at, newer_than=old_token, timeout_s=10)
    await cluster.until_runs(JOB, 10, since=first.start, timeout_s=5)
    runs = cluster.runs(JOB)
    window = [r for r in runs if r.start > restart_at - 1]
    new_terms = [term for term in cluster.terms(JOB) if term.t > restart_at]
    late, rejected = stale_writes(runs)
    record.add(
        "14",
        "redis-restart-empty",
        restart_s=restarted_at - restart_at,
        leader_after_restart_s=first.start - restarted_at,
        overlap_s=overlap_s(window),
        rejected_writes=rejected,
    )
    # Known limit: the key is gone, a second node may acquire before the old leader's next
    # round; bounded by a heartbeat plus a run.
    assert overlap_s(window) <= t.heartbeat + RUN_S + TOL_S
    assert all(term.token > old_token for term in new_terms)  # the TIME floor of the fence
    assert first.start - restarted_at <= t.max_backoff + EVERY_S + TOL_S


async def test_row15_redis_restarted_with_aof(cluster: Cluster, record: Results) -> None:
    # A longer lease, so that a restart (SIGTERM, AOF fsync, start, load) fits well inside.
    timing = Timing(heartbeat=0.2, lock_expiry=2.0)
    await three_replicas(cluster, timing=timing, appendonly=True)
    store = cluster.store
    assert store is not None
    lock = _keys.job_key(cluster.project, JOB, "lock")
    with store_client(cluster) as client:
        before = client.get(lock)
    restart_at = now()
    await asyncio.to_thread(store.restart)
    restarted_at = now()
    with store_client(cluster) as client:
        after, ttl_ms = client.get(lock), client.pttl(lock)
    await cluster.until_runs(JOB, 10, since=restarted_at, timeout_s=5)
    terms = cluster.terms(JOB)
    record.add(
        "15",
        "redis-restart-aof",
        restart_s=restarted_at - restart_at,
        transitions=len(terms) - 1,
        lock_survived=after == before,
        ttl_after_ms=ttl_ms,
    )
    assert after == before and ttl_ms > 0  # the lock came back with its TTL
    assert len(terms) == 1, terms  # the same leader goes on
    assert max_concurrent(cluster.runs(JOB)) == 1


async def test_row16_redis_down_when_the_apps_start(cluster: Cluster, record: Results) -> None:
    t = cluster.timing
    store = cluster.redis()
    store.kill()
    nodes = [cluster.replica(f"n{i}", [TICK], http=True) for i in (1, 2)]
    await cluster.ready(*nodes)  # the lifespan's startup does not wait for Redis
    for node in nodes:
        live = await cluster.get(node, "/sj/health/live")
        ready = await cluster.get(node, "/sj/health/jobs")
        assert live is not None and live.status_code == 200
        assert ready is not None and ready.status_code == 503, ready
        assert "lease store" in ready.json()["reason"]
    down_s = 2.0
    await cluster.sleep(down_s)
    assert cluster.runs(JOB) == []
    await asyncio.to_thread(store.restart)
    up_at = now()
    first = await cluster.first_run(JOB, after=up_at, newer_than=0, timeout_s=10)

    async def all_ready() -> bool:
        answers = [await cluster.get(node, "/sj/health/jobs") for node in nodes]
        return all(a is not None and a.status_code == 200 for a in answers)

    ready_at = await cluster.wait(all_ready, 5, "/sj/health/jobs is 200 everywhere")
    record.add(
        "16",
        "redis-down-at-startup",
        leader_after_redis_s=first.start - up_at,
        ready_after_redis_s=ready_at - up_at,
    )
    assert first.start - up_at <= t.max_backoff + t.heartbeat + EVERY_S + TOL_S
    assert max_concurrent(cluster.runs(JOB)) == 1


@pytest.mark.parametrize("rep", reps(3))
async def test_row17_redis_killed_then_restarted_empty(
    cluster: Cluster, record: Results, rep: int
) -> None:
    t = cluster.timing
    leader = await three_replicas(cluster)
    store = cluster.store
    assert store is not None
    old_token = (await cluster.mid_run(JOB, leader)).token
    killed_at = now()
    await asyncio.to_thread(store.kill)
    await cluster.sleep(killed_at + 2 * t.lock_expiry - now())
    await asyncio.to_thread(store.restart)
    restarted_at = now()
    first = await cluster.first_run(JOB, after=restarted_at, newer_than=old_token, timeout_s=10)
    await cluster.until_runs(JOB, 5, since=first.start, timeout_s=5)
    events = cluster.events()
    lost = next(e for e in events if e.ev == "lost" and e.node == leader and e.t > killed_at)
    last_old = max(r.start for r in cluster.runs(JOB) if r.token == old_token)
    reached = sorted(
        round(e.t - restarted_at, 3) for e in events if e.ev == "reached" and e.t > restarted_at
    )
    record.add(
        "17",
        "redis-kill-2T-restart-empty",
        stop_latency_s=lost.t - killed_at,
        leader_after_restart_s=first.start - restarted_at,
        reconnected_after_s=reached,
    )
    assert last_old <= killed_at + t.lease_s + 0.02
    assert lost.t - killed_at <= t.lease_s + TOL_S
    assert first.start - restarted_at <= t.max_backoff + t.heartbeat + EVERY_S + TOL_S
    assert max_concurrent(cluster.runs(JOB)) == 1


async def lost_key_row(
    cluster: Cluster, record: Results, row: str, name: str, fault: Callable[[redis.Redis], object]
) -> None:
    """Make Redis lose the lock with ``fault`` while the job runs; check and record the
    overlap, the notice time and the fenced writes."""
    t = cluster.timing
    await three_replicas(cluster)
    old_token = cluster.runs(JOB)[-1].token
    await cluster.until_runs(JOB, 3, since=now(), timeout_s=5)
    lock = _keys.job_key(cluster.project, JOB, "lock")
    with store_client(cluster) as client:
        held = client.get(lock)
        for _ in range(5):
            fault_at = now()
            fault(client)
            await cluster.sleep(0.005)
            # A renewal landing within the 1 ms of an early expiry undoes it: try again.
            if client.get(lock) != held:
                break
        else:
            raise AssertionError("the fault never took effect")
    first = await cluster.first_run(JOB, after=fault_at, newer_than=old_token, timeout_s=5)
    await cluster.until_runs(JOB, 10, since=first.start, timeout_s=5)
    runs = cluster.runs(JOB)
    window = [r for r in runs if r.start > fault_at - 1]
    new_term = next(term for term in cluster.terms(JOB) if term.token > old_token)
    stale = [r for r in runs if r.token == old_token and r.start > fault_at]
    late, rejected = stale_writes(window)
    record.add(
        row,
        name,
        new_term_after_s=new_term.t - fault_at,
        same_node=new_term.node == runs[-11].node,
        overlap_s=overlap_s(window),
        stale_runs=len(stale),
        duplicate_ticks=len(duplicates(window)),
        late_writes=late,
        rejected_writes=rejected,
    )
    # Known limit (S2): the old leader runs on until its next round, about one heartbeat.
    assert overlap_s(window) <= t.heartbeat + RUN_S + TOL_S
    assert all(r.start <= fault_at + t.heartbeat + TOL_S for r in stale)
    assert new_term.t - fault_at <= t.heartbeat + TOL_S
    assert new_term.token > old_token
    # The stale term never writes after the new term's first accepted write.
    first_new = first_accepted(window, above=old_token)
    assert all(not w.ok for r in stale for w in writes_sent_after(r, first_new))


@pytest.mark.parametrize("rep", reps(5))
async def test_row19_lock_deleted(cluster: Cluster, record: Results, rep: int) -> None:
    lock = _keys.job_key(cluster.project, JOB, "lock")
    await lost_key_row(cluster, record, "19", "del-lock", lambda c: c.delete(lock))


@pytest.mark.parametrize("rep", reps(3))
async def test_row21_flushall(cluster: Cluster, record: Results, rep: int) -> None:
    await lost_key_row(cluster, record, "21", "flushall", lambda c: c.flushall())


@pytest.mark.parametrize("rep", reps(3))
async def test_row22_early_expiry(cluster: Cluster, record: Results, rep: int) -> None:
    # What a forward step of the Redis host's clock does (libfaketime cannot wrap
    # redis-server): the lock expires early.
    lock = _keys.job_key(cluster.project, JOB, "lock")
    await lost_key_row(cluster, record, "22", "pexpire-1ms", lambda c: c.pexpire(lock, 1))


def evict(cluster: Cluster, client: redis.Redis) -> int:
    """Lower maxmemory just under what is used, write 10 kB filler keys (with a TTL of an
    hour) until the lock is evicted, then lift the limit. Returns the filler keys written."""
    lock = _keys.job_key(cluster.project, JOB, "lock")
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + 200_000)
    written = 0
    try:
        while client.exists(lock) and written < 2000:
            with client.pipeline(transaction=False) as pipe:
                for _ in range(20):
                    pipe.set(f"filler:{written}", "x" * 10_000, ex=3600)
                    written += 1
                pipe.execute()
    finally:
        client.config_set("maxmemory", 0)
    return written


@pytest.mark.parametrize("policy", ["volatile-ttl", pytest.param("allkeys-lru", marks=full_only)])
async def test_row20_lock_evicted(cluster: Cluster, record: Results, policy: str) -> None:
    t = cluster.timing
    await three_replicas(cluster, extra_args=("--maxmemory", "100mb", "--maxmemory-policy", policy))
    old_token = cluster.runs(JOB)[-1].token
    with store_client(cluster) as client:
        fault_at = now()
        written = await asyncio.to_thread(evict, cluster, client)
        evicted = int(client.info("stats")["evicted_keys"])
    lock_evicted = written < 2000  # the filling stopped because the lock was gone
    first = await cluster.first_run(JOB, after=fault_at, newer_than=old_token, timeout_s=5)
    await cluster.until_runs(JOB, 10, since=first.start, timeout_s=5)
    runs = [r for r in cluster.runs(JOB) if r.start > fault_at - 1]
    warned = [
        line
        for line in "\n".join(r.output() for r in cluster.replicas.values()).splitlines()
        if "WARNING" in line and policy in line
    ]
    record.add(
        "20",
        f"evicted-{policy}",
        filler_keys=written,
        evicted_keys=evicted,
        overlap_s=overlap_s(runs),
        startup_warnings=len(warned),
    )
    assert lock_evicted
    assert overlap_s(runs) <= t.heartbeat + RUN_S + TOL_S
    # An evicting policy is a misconfiguration for a lock store: every replica says so.
    assert len(warned) >= len(cluster.replicas), "no startup WARNING naming the policy"


async def fill_until_oom(client: redis.Redis) -> None:
    """Write 2 MB of filler and set maxmemory below what is used: with ``noeviction`` every
    command that may add memory now fails with OOM."""
    with client.pipeline(transaction=False) as pipe:
        for i in range(200):
            pipe.set(f"filler:{i}", "x" * 10_000)
        pipe.execute()
    client.config_set("maxmemory", "1mb")


async def test_row20b_noeviction_and_out_of_memory(cluster: Cluster, record: Results) -> None:
    t = cluster.timing
    leader = await three_replicas(cluster, extra_args=("--maxmemory-policy", "noeviction"))
    with store_client(cluster) as client:
        await fill_until_oom(client)
        full_at = now()
        await cluster.until_runs(JOB, 10, since=full_at, timeout_s=5)
        kept = len(cluster.terms(JOB)) == 1  # PEXPIRE needs no memory: the leader renews
        killed_at = cluster.replica_of(leader).kill()
        await cluster.sleep(2.0)
        during = [r for r in cluster.runs(JOB) if r.start > killed_at]
        oom_logged = cluster.log_has("OOM command not allowed")
        client.config_set("maxmemory", 0)
        freed_at = now()
    first = await cluster.first_run(JOB, after=freed_at, newer_than=0, timeout_s=10)
    record.add(
        "20b",
        "noeviction-oom",
        leader_kept_while_full=kept,
        runs_without_leader=len(during),
        leader_after_freeing_s=first.start - freed_at,
        oom_in_logs=oom_logged,
    )
    assert kept
    assert during == []  # nobody can acquire while Redis refuses writes: safe
    assert oom_logged
    assert first.start - freed_at <= t.max_backoff + t.heartbeat + EVERY_S + TOL_S
    assert max_concurrent(cluster.runs(JOB)) == 1


async def test_row20c_out_of_memory_while_another_lock_is_free(
    cluster: Cluster, record: Results
) -> None:
    # Node b leads job "other"; node a leads "tick" and also wants "other". With Redis full,
    # b dies: a's round now tries to acquire "other", which fails with OOM.
    other = JobConfig("other", kind="rate", every=EVERY_S, run_s=RUN_S)
    cluster.redis(extra_args=("--maxmemory-policy", "noeviction"))
    b = cluster.replica("b", [other])
    await cluster.ready(b)
    assert await cluster.wait_leader("other") == "b"
    # "other" first: its acquisition is then the script's first write, which Redis refuses
    # under OOM (a write after an earlier one in the same script is let through).
    a = cluster.replica("a", [other, TICK])
    await cluster.ready(a)
    assert await cluster.wait_leader(JOB) == "a"
    with store_client(cluster) as client:
        await fill_until_oom(client)
        killed_at = b.kill()
        await cluster.sleep(2.0)
        terms = cluster.terms(JOB)
        runs = [r for r in cluster.runs(JOB) if r.start > killed_at + 1.0]
        record.add("20c", "oom-batched-renewal", tick_terms=len(terms), tick_runs_late=len(runs))
        client.config_set("maxmemory", 0)
    # Expected: a keeps leading "tick" (its renewal needs no memory) while "other" has no
    # leader until memory is freed.
    assert len(terms) == 1
    assert len(runs) >= 5


@full_only
async def test_row14_repeated_restarts(cluster: Cluster, record: Results) -> None:
    # Five restarts without persistence in a row, a second apart: tokens keep growing.
    await three_replicas(cluster)
    store = cluster.store
    assert store is not None
    for _ in range(5):
        await asyncio.to_thread(store.restart)
        await cluster.until_runs(JOB, 5, since=now(), timeout_s=10)
    runs = cluster.runs(JOB)
    tokens = [term.token for term in cluster.terms(JOB)]
    record.add("14", "five-restarts", terms=len(tokens), overlap_s=overlap_s(runs))
    assert tokens == sorted(tokens)
    assert overlap_s(runs) <= 5 * (cluster.timing.heartbeat + RUN_S + TOL_S)
