"""Rows 8-12 and 29: the network between replicas and Redis, through the in-repo fault proxy.

The proxy (``tests/fault_proxy.py``) runs in the test's event loop. Rows 8, 9, 10 and 29
put it between the leader alone and Redis (the followers connect directly); rows 11 and 12
put every replica behind one proxy. Modes: blackhole (nothing either way, bytes held as TCP
holds them), drop_responses (requests arrive, replies are discarded), reset (RST on every
connection), latency (each chunk delayed in each direction).
"""

from __future__ import annotations

import math

import pytest
from fault_proxy import FaultProxy

from .checker import first_accepted, max_concurrent, overlap_s, stale_writes, writes_sent_after
from .harness import FULL, TOL_S, Cluster, Results, Timing, full_only, now, reps
from .replica import JobConfig

JOB = "tick"
EVERY_S = 0.1
# Without a checkpoint: these rows are about the election; a checkpoint's write after each run
# would take a round trip of the slowed link per run (docs/checkpoints.md, "Opting out").
TICK = JobConfig(JOB, kind="rate", every=EVERY_S, run_s=0.03, checkpoint=False)


async def proxied_leader(
    cluster: Cluster, job: JobConfig = TICK, timing: Timing | None = None
) -> FaultProxy:
    """The store, a leader ``p`` behind a proxy, and two followers connected directly."""
    cluster.redis()
    proxy = await cluster.proxy()
    leader = cluster.replica("p", [job], url=proxy.url, timing=timing)
    await cluster.ready(leader)
    assert await cluster.wait_leader(job.name) == "p"
    followers = [cluster.replica(f"n{i}", [job], timing=timing) for i in (1, 2)]
    await cluster.ready(*followers)
    await cluster.until_runs(job.name, 3, since=now(), timeout_s=10)
    return proxy


def asymmetric_bound(t: Timing) -> float:
    """Worst time from "replies are lost" to a successor's run, by the election rules.

    The old leader's requests still renew its lock. It renews each heartbeat until its lease
    deadline, then retries with backoff: a call that times out after a heartbeat, then a
    delay in ``[base/2, base]``, ``base = min(max_backoff, heartbeat * 2**failures)``. The
    lock expires only in a gap between two of its requests longer than the lock expiry.
    Infinite when ``heartbeat + max_backoff / 2`` never exceeds the lock expiry.
    """
    h = t.heartbeat
    first = math.ceil(t.lease_s / (2 * h)) + 1
    elapsed = first * 2 * h
    for failures in range(first, first + 64):
        base = min(t.max_backoff, h * 2.0**failures)
        if h + base / 2 > t.lock_expiry:
            return elapsed + t.lock_expiry + h + EVERY_S + TOL_S
        elapsed += h + base
    return math.inf


@pytest.mark.parametrize("rep", reps(5))
async def test_row08_leader_blackholed(cluster: Cluster, record: Results, rep: int) -> None:
    t = cluster.timing
    proxy = await proxied_leader(cluster)
    old_token = cluster.runs(JOB)[-1].token
    cut_at = now()
    proxy.blackhole()
    try:
        first = await cluster.first_run(
            JOB, after=cut_at, newer_than=old_token, timeout_s=t.lock_expiry + 5
        )
        await cluster.sleep(cut_at + 3 * t.lock_expiry - now())
    finally:
        proxy.pass_through()
    healed_at = now()
    await cluster.until_runs(JOB, 10, since=healed_at, timeout_s=5)
    runs = cluster.runs(JOB)
    events = cluster.events()
    lost = next(e for e in events if e.ev == "lost" and e.node == "p" and e.t > cut_at)
    last_old = max(r.start for r in runs if r.node == "p" and r.token == old_token)
    record.add(
        "8",
        "blackhole-leader-3T",
        takeover_s=first.start - cut_at,
        stop_latency_s=lost.t - cut_at,
        last_old_start_s=last_old - cut_at,
        overlap_s=overlap_s(runs),
    )
    # The old leader never starts a run past its lease deadline, and ends its term there.
    assert last_old <= cut_at + t.lease_s + 0.02
    assert lost.t - cut_at <= t.lease_s + TOL_S
    assert first.start - cut_at <= t.lock_expiry + EVERY_S + TOL_S
    assert max_concurrent(runs) == 1
    # Healed, the old leader stays a follower: the lock is someone else's.
    assert not [e for e in events if e.ev == "lead" and e.node == "p" and e.t > cut_at]
    assert not [r for r in runs if r.node == "p" and r.start > cut_at + t.lease_s]


@pytest.mark.parametrize("rep", reps(5))
async def test_row09_leader_replies_dropped(cluster: Cluster, record: Results, rep: int) -> None:
    t = cluster.timing
    bound = asymmetric_bound(t)
    proxy = await proxied_leader(cluster)
    old_token = cluster.runs(JOB)[-1].token
    cut_at = now()
    proxy.drop_responses()
    try:
        first = await cluster.first_run(JOB, after=cut_at, newer_than=old_token, timeout_s=bound)
    finally:
        proxy.pass_through()
    await cluster.until_runs(JOB, 5, since=now(), timeout_s=5)
    runs = cluster.runs(JOB)
    last_old = max(r.ended_by(0.0) for r in runs if r.node == "p" and r.token == old_token)
    record.add(
        "9",
        "drop-replies-leader",
        takeover_s=first.start - cut_at,
        no_runner_s=first.start - last_old,
        bound_s=bound,
    )
    assert max_concurrent(runs) == 1
    assert last_old <= cut_at + t.lease_s + 0.05
    # The matrix asks for 2T + 1.2P. The old leader's calls time out and its connection is
    # dropped; a new connection's handshake (HELLO 3) needs a reply, so no renewal gets
    # through after the first timeout and the lock expires one T later.
    assert first.start - cut_at <= 2 * t.lock_expiry + 1.2 * t.heartbeat + EVERY_S + TOL_S


async def proxied_leader_without_handshake(cluster: Cluster, timing: Timing) -> FaultProxy:
    """Like :func:`proxied_leader`, but ``p`` gets ``redis=`` a client that sends nothing on
    connect (RESP2, ``lib_name=None``): its first request on a new connection is the
    election script itself, which takes effect without a reply. (redis-py 8's default
    ``HELLO 3`` handshake needs a reply, so with it a reconnect sends no renewal.)"""
    cluster.redis()
    proxy = await cluster.proxy()
    extra = {"no_handshake": True}
    leader = cluster.replica("p", [TICK], url=proxy.url, timing=timing, client_pool=8, extra=extra)
    await cluster.ready(leader)
    assert await cluster.wait_leader(JOB) == "p"
    followers = [cluster.replica(f"n{i}", [TICK], timing=timing) for i in (1, 2)]
    await cluster.ready(*followers)
    await cluster.until_runs(JOB, 3, since=now(), timeout_s=10)
    return proxy


@pytest.mark.parametrize(
    "max_backoff",
    [
        1.0,
        0.2,
    ],
)
@full_only
async def test_row09b_replies_dropped_renewals_still_applied(
    cluster: Cluster, record: Results, max_backoff: float
) -> None:
    # Row 9 again, with the leader's renewals still reaching Redis after its calls time
    # out: its own lock stays alive while it is a follower, and nobody runs the job until a
    # backoff gap is longer than the lock expiry. With max_backoff + heartbeat < lock
    # expiry, that never happens while the partition lasts.
    timing = Timing(max_backoff=max_backoff)
    t = timing
    proxy = await proxied_leader_without_handshake(cluster, timing)
    old_token = cluster.runs(JOB)[-1].token
    cut_at = now()
    proxy.drop_responses()
    hold_s = 4.0
    try:
        try:
            first = await cluster.first_run(
                JOB, after=cut_at, newer_than=old_token, timeout_s=hold_s
            )
            took = first.start - cut_at
        except AssertionError:
            took = math.inf
    finally:
        proxy.pass_through()
    runs = cluster.runs(JOB)
    record.add(
        "9b",
        f"drop-replies-renewals-applied-backoff-{max_backoff:g}",
        takeover_s=took,
        library_bound_s=asymmetric_bound(t),
        matrix_bound_s=2 * t.lock_expiry + 1.2 * t.heartbeat + EVERY_S + TOL_S,
    )
    assert max_concurrent(runs) == 1
    if max_backoff < t.lock_expiry - t.heartbeat:
        # The matrix: the old leader goes quiet once it stepped down, a successor within
        # 2T + 1.2P. Here its backoff gaps never exceed T: no successor at all.
        assert took <= 2 * t.lock_expiry + 1.2 * t.heartbeat + EVERY_S + TOL_S
    else:
        # A backoff gap longer than T lets the lock expire: the library's own bound.
        assert took <= asymmetric_bound(t)


@pytest.mark.parametrize("rep", reps(3))
async def test_row10_connection_resets(cluster: Cluster, record: Results, rep: int) -> None:
    proxy = await proxied_leader(cluster)
    began = now()
    duration = 10.0 if FULL else 4.0
    resets = 0
    while now() - began < duration:
        proxy.reset()
        resets += 1
        await cluster.sleep(0.5)
    await cluster.until_runs(JOB, 5, since=now(), timeout_s=5)
    runs = [r for r in cluster.runs(JOB) if r.start >= began]
    transitions = len([term for term in cluster.terms(JOB) if term.t >= began])
    longest = max(b.start - a.start for a, b in zip(runs, runs[1:], strict=False))
    record.add(
        "10", "reset-every-0.5s", resets=resets, transitions=transitions, longest_gap_s=longest
    )
    assert max_concurrent(cluster.runs(JOB)) == 1
    assert transitions <= 1
    assert longest <= 2 * EVERY_S + TOL_S


async def test_row11_latency_twice_the_heartbeat(cluster: Cluster, record: Results) -> None:
    t = cluster.timing
    cluster.redis()
    proxy = await cluster.proxy()
    nodes = [cluster.replica(f"n{i}", [TICK], url=proxy.url) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    await cluster.one_leader(JOB)
    slow_at = now()
    proxy.latency(t.heartbeat)  # each way: a round trip of two heartbeats < T - margin
    try:
        await cluster.sleep(3.0)
        runs = [r for r in cluster.runs(JOB) if r.start > slow_at]
        transitions = len([term for term in cluster.terms(JOB) if term.t > slow_at])
        record.add("11", "latency-2H", runs=len(runs), transitions=transitions)
    finally:
        proxy.pass_through()
    assert transitions == 0
    assert len(runs) >= 20  # about 30 ticks in 3 s


async def test_row12_latency_above_the_lock_expiry(cluster: Cluster, record: Results) -> None:
    t = cluster.timing
    cluster.redis()
    proxy = await cluster.proxy()
    nodes = [cluster.replica(f"n{i}", [TICK], url=proxy.url) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    await cluster.one_leader(JOB)
    slow_at = now()
    proxy.latency(t.lock_expiry)  # each way: a round trip of 2T
    try:
        await cluster.sleep(3.0)
    finally:
        proxy.pass_through()
    healed_at = now()
    old_token = max(r.token for r in cluster.runs(JOB))
    first = await cluster.first_run(JOB, after=healed_at, newer_than=0, timeout_s=10)
    runs = cluster.runs(JOB)
    during = [r for r in runs if slow_at + t.lease_s + 0.02 < r.start < healed_at]
    bound = t.max_backoff + t.heartbeat + t.lock_expiry + EVERY_S + TOL_S
    record.add(
        "12",
        "latency-2T",
        runs_during=len(during),
        leader_after_heal_s=first.start - healed_at,
        new_term=first.token > old_token,
    )
    # No grant that arrives after its own deadline starts a run: nobody runs meanwhile.
    assert during == []
    assert max_concurrent(runs) == 1
    # After the latency drops: the backoff (max_backoff) plus one expiry at most.
    assert first.start - healed_at <= bound


@pytest.mark.parametrize("rep", reps(3))
async def test_row29_job_ignores_cancellation_on_lease_loss(
    cluster: Cluster, record: Results, rep: int
) -> None:
    t = cluster.timing
    hold_s = 2 * t.lock_expiry
    job = JobConfig(
        JOB, kind="interval", every=0.5, run_s=1.0, steps=5, policy="cancel",
        behavior="ignore_cancel", hold_s=hold_s,
    )  # fmt: skip
    proxy = await proxied_leader(cluster, job)
    run = await cluster.mid_run(JOB, "p")
    cut_at = now()
    proxy.blackhole()
    try:
        first = await cluster.first_run(
            JOB, after=cut_at, newer_than=run.token, timeout_s=t.lock_expiry + 5
        )
        await cluster.wait(lambda: cluster.in_flight(JOB, "p") is None, hold_s + 5, "it ends")
    finally:
        proxy.pass_through()
    runs = cluster.runs(JOB)
    ignoring = next(r for r in runs if r.run == run.run)
    cancel = next(e for e in cluster.events() if e.ev == "cancel_ignored" and e.run == run.run)
    late, rejected = stale_writes(runs)
    successor_write = first_accepted(runs, above=run.token)
    overlap = overlap_s(runs)
    record.add(
        "29",
        "ignores-cancel-2T",
        cancel_after_cut_s=cancel.t - cut_at,
        overlap_s=overlap,
        late_writes=late,
        rejected_writes=rejected,
    )
    # The library cancels at the lease deadline...
    assert cancel.t - cut_at <= t.lease_s + TOL_S
    # ...but cannot stop a job that swallows the cancellation: the overlap is what the job
    # keeps running after the successor starts (known limit), and fencing rejects its writes.
    assert ignoring.end is not None
    assert overlap <= ignoring.end - first.start + 0.01
    assert all(not w.ok for w in writes_sent_after(ignoring, successor_write))
