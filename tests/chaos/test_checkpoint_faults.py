"""Rows 49-50: checkpoints (issue 12) under a Redis restart and a leader's SIGKILL.

The jobs follow the cursor pattern of docs/checkpoints.md (``behavior="cursor"`` in
``replica.py``): a run resumes from ``ctx.checkpoint.state`` (an int, None at first) and saves
cursor + 1 with ``ctx.save_state`` after each of its steps; a refused or failed save ends the
run. Each run journals the state, iteration and writing term it was given, and each save its
value, when it was sent, and how it was answered (or not: a SIGKILL, a connection error).

What is checked on those journals:

- *resumes*: a run resumes from the state stored when it began: the value of the last save
  answered before it started, or of a later one whose outcome is unknown (no answer, or a
  connection error: it may have been written);
- *lost*: a save that was answered, yet a later run resumed from a smaller value;
- *repeated*: a value answered twice (two runs did the same step);
- no run of a new term is given a record written by a stale term (``cp_token``), and no stale
  term's save is answered once the new term has begun.

Rows:

- 49a: Redis restarted with AOF (``appendfsync always``) mid-run: the lock, and so the term,
  survive; the state and the iteration go on from where they were;
- 49b: Redis restarted empty (no persistence) mid-run: the record is lost with the lock, as
  docs/checkpoints.md says (as durable as Redis is): the next term starts from no state and
  iteration 1, and never sees the state of the term before the restart;
- 49c: Redis killed and restarted from an RDB snapshot taken 2T earlier: the record comes back
  as the snapshot holds it, written by the term before, so the next term resumes from there
  and does again what was saved since (a known limit: the state is as durable as Redis is;
  ``appendfsync always`` is what row 49a runs);
- 50: SIGKILL of the leader while it saves state: the successor resumes from the last value
  saved (or the one in flight, if Redis had it), so no value is lost and at most one step is
  done again; the killed run's record (its iteration) is the documented SIGKILL window.
"""

from __future__ import annotations

import asyncio
import math
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pytest

from fastapi_singletonjob._store import keys as _keys

from .checker import Event, max_concurrent, overlap_s
from .harness import TOL_S, Cluster, Results, Timing, now, reps
from .replica import JobConfig

EVERY_S = 0.1
RATE = JobConfig("cursor", kind="rate", every=EVERY_S, behavior="cursor", run_s=0.03, steps=5)
INTERVAL = JobConfig(
    "icursor", kind="interval", every=EVERY_S, behavior="cursor", run_s=0.03, steps=5
)
SAVING = JobConfig("cursor", kind="rate", every=EVERY_S, behavior="cursor", run_s=0.0, steps=30)
"""Saves back to back (30 per run, about 1 ms each): a SIGKILL mid-run lands mid-save."""
AOF_TIMING = Timing(heartbeat=0.2, lock_expiry=2.0)
"""Row 15's: a restart (SIGTERM, AOF fsync, start, load) fits well inside the lease."""


# -- the journals of cursor jobs -----------------------------------------------------------------


@dataclass(frozen=True)
class Save:
    """One ``ctx.save_state`` call of a cursor run."""

    run: str
    node: str
    token: int
    value: int
    sent: float
    done: float | None
    """When the answer (or the error) was journaled; None: the process died first."""
    error: str | None

    @property
    def ok(self) -> bool:
        """Answered: the value is stored."""
        return self.done is not None and self.error is None

    @property
    def unknown(self) -> bool:
        """It may or may not have been written: no answer, or a connection error. A
        ``LeadershipLost`` is a refusal inside Redis: nothing was written."""
        return self.done is None or self.error not in (None, "LeadershipLost")


@dataclass(frozen=True)
class Given:
    """What a cursor run was given when it began."""

    run: str
    node: str
    token: int
    t: float
    state: int | None
    iteration: int
    cp_token: int | None
    """The term that wrote the record the run was given (None: no record)."""


def saves_of(events: Iterable[Event], job: str) -> list[Save]:
    """Every save of ``job``, in the order they were sent."""
    sent: dict[tuple[str, int], Event] = {}
    answers: dict[tuple[str, int], Event] = {}
    for event in events:
        if event.job != job or event.run is None:
            continue
        if event.ev == "saving":
            sent[(event.run, int(event.data["value"]))] = event
        elif event.ev == "saved":
            answers[(event.run, int(event.data["value"]))] = event
    found = []
    for key, event in sent.items():
        answer = answers.get(key)
        assert event.token is not None
        found.append(
            Save(
                run=key[0],
                node=event.node,
                token=event.token,
                value=key[1],
                sent=event.t,
                done=None if answer is None else answer.t,
                error=None if answer is None or answer.data["ok"] else answer.data["error"],
            )
        )
    return sorted(found, key=lambda s: s.sent)


def given_of(events: Iterable[Event], job: str) -> list[Given]:
    """What each cursor run of ``job`` was given, in start order."""
    return [
        Given(
            run=event.run,
            node=event.node,
            token=event.token,
            t=event.t,
            state=event.data["state"],
            iteration=int(event.data["iteration"]),
            cp_token=event.data["cp_token"],
        )
        for event in events
        if event.ev == "start"
        and event.job == job
        and event.run is not None
        and event.token is not None
        and "iteration" in event.data
    ]


def last_answered(saves: Iterable[Save], before: float) -> Save | None:
    """The save answered last before ``before``."""
    answered = [s for s in saves if s.ok and s.done is not None and s.done < before]
    return max(answered, key=lambda s: s.done or 0.0, default=None)


def allowed_states(saves: Sequence[Save], at: float) -> set[int | None]:
    """The states a run that began at ``at`` may be given: the last answered value, or that
    of a later save sent before ``at`` that may have been written (unknown outcome, or
    answered only after ``at``)."""
    last = last_answered(saves, at)
    since = -math.inf if last is None else last.sent
    allowed: set[int | None] = {None if last is None else last.value}
    for save in saves:
        if since < save.sent < at and (save.unknown or (save.ok and (save.done or 0.0) >= at)):
            allowed.add(save.value)
    return allowed


def bad_resumes(given: Iterable[Given], saves: Sequence[Save]) -> list[str]:
    """The runs that resumed from anything but the stored state (see ``allowed_states``)."""
    return [
        f"{g.run} (token {g.token}) began at {g.t:.3f} with {g.state!r}, "
        f"not one of {sorted(allowed_states(saves, g.t), key=str)}"
        for g in given
        if g.state not in allowed_states(saves, g.t)
    ]


def lost_values(given: Iterable[Given], saves: Sequence[Save]) -> int:
    """Runs that resumed from below a value answered before they began."""
    lost = 0
    for g in given:
        last = last_answered(saves, g.t)
        lost += last is not None and (g.state or 0) < last.value
    return lost


def repeated_values(saves: Iterable[Save]) -> list[int]:
    """Values answered more than once: a step that two runs did and both saved."""
    seen: dict[int, int] = {}
    for save in saves:
        if save.ok:
            seen[save.value] = seen.get(save.value, 0) + 1
    return sorted(value for value, count in seen.items() if count > 1)


def redone_steps(saves: Sequence[Save]) -> int:
    """Steps attempted again: saves of a value some earlier save (of another run) had sent."""
    redone = 0
    for i, save in enumerate(saves):
        redone += any(s.value == save.value and s.run != save.run for s in saves[:i])
    return redone


def state_gap_s(saves: Sequence[Save], at: float) -> float | None:
    """From the last save answered before ``at`` to the first answered after it."""
    before = last_answered(saves, at)
    after = [s.done for s in saves if s.ok and s.done is not None and s.sent > at]
    if before is None or before.done is None or not after:
        return None
    return min(after) - before.done


async def wait_saves(cluster: Cluster, job: str, count: int, *, since: float) -> None:
    """Wait until ``count`` saves of ``job`` were answered since ``since``."""
    await cluster.wait(
        lambda: sum(s.ok and s.sent > since for s in saves_of(cluster.events(), job)) >= count,
        10,
        f"{count} saves of {job} answered since {since:.3f}",
    )


async def saving(cluster: Cluster, job: str, node: str, timeout_s: float = 10.0) -> Save:
    """Wait until ``node`` has sent a save of ``job`` it has no answer to yet; return it."""
    seen: list[Save] = []

    def in_flight() -> bool:
        saves = saves_of(cluster.events(), job)
        seen.extend(s for s in saves if s.node == node and s.done is None)
        return bool(seen)

    await cluster.wait(in_flight, timeout_s, f"{node} saves {job}", poll_s=0.001)
    return seen[-1]


async def cursor_cluster(cluster: Cluster, *, timing: Timing | None = None, aof: bool) -> str:
    """The store and three replicas running both cursor jobs; return the leader of the
    fixed-rate one once it has saved a few values (each job has one leader, maybe not the
    same)."""
    cluster.redis(appendonly=aof)
    nodes = [cluster.replica(f"n{i}", [RATE, INTERVAL], timing=timing) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    leader = await cluster.one_leader(RATE.name)
    await cluster.one_leader(INTERVAL.name)
    await wait_saves(cluster, RATE.name, 10, since=0.0)
    return leader


# -- row 49: Redis restarted while a cursor job runs -------------------------------------------


@pytest.mark.parametrize("rep", reps(3))
async def test_row49a_redis_restarted_with_aof_keeps_the_checkpoint(
    cluster: Cluster, record: Results, rep: int
) -> None:
    leader = await cursor_cluster(cluster, timing=AOF_TIMING, aof=True)
    store = cluster.store
    assert store is not None
    await saving(cluster, RATE.name, leader)
    restart_at = now()
    await asyncio.to_thread(store.restart)  # SIGTERM, same port and data dir: AOF replayed
    restarted_at = now()
    for job in (RATE, INTERVAL):
        await cluster.until_runs(job.name, 5, since=restarted_at, timeout_s=10)
        await wait_saves(cluster, job.name, 10, since=restarted_at)
    events = cluster.events()
    for job in (RATE, INTERVAL):
        saves = saves_of(events, job.name)
        given = given_of(events, job.name)
        before = [g for g in given if g.t < restart_at]
        after = [g for g in given if g.t > restarted_at]
        last = last_answered(saves, restart_at)
        assert last is not None and before and after
        failed = [s for s in saves if restart_at - 0.5 < s.sent and s.error is not None]
        record.add(
            "49a",
            f"redis-restart-aof-{job.kind}",
            restart_s=restarted_at - restart_at,
            transitions=len(cluster.terms(job.name)) - 1,
            last_saved_before=last.value,
            first_given_after=after[0].state,
            iteration_before=before[-1].iteration,
            iteration_after=after[0].iteration,
            saves_failed=len(failed),
            lost=lost_values(given, saves),
            repeated=len(repeated_values(saves)),
            redone_steps=redone_steps(saves),
            state_gap_s=state_gap_s(saves, restart_at),
        )
        # The lock and the record come back: the same term goes on, from the stored state.
        assert len(cluster.terms(job.name)) == 1, cluster.terms(job.name)
        assert bad_resumes(given, saves) == []
        assert lost_values(given, saves) == 0
        assert repeated_values(saves) == []
        assert redone_steps(saves) <= 1  # a save whose outcome was unknown and not written
        assert after[0].state is not None and after[0].state >= last.value
        # Cluster-wide iteration: never back to 1. A run whose record could not be written
        # while Redis was down leaves its number to the next one.
        assert after[0].iteration >= before[-1].iteration
        assert [g.iteration for g in given] == sorted(g.iteration for g in given)
        assert max_concurrent(cluster.runs(job.name)) == 1


@pytest.mark.parametrize("rep", reps(3))
async def test_row49b_redis_restarted_empty_loses_the_checkpoint(
    cluster: Cluster, record: Results, rep: int
) -> None:
    t = cluster.timing
    leader = await cursor_cluster(cluster, aof=False)
    store = cluster.store
    assert store is not None
    old_tokens = {
        job.name: max(term.token for term in cluster.terms(job.name)) for job in (RATE, INTERVAL)
    }
    await saving(cluster, RATE.name, leader)
    restart_at = now()
    await asyncio.to_thread(store.restart)  # SIGTERM (no save configured), same port, empty
    restarted_at = now()
    for job in (RATE, INTERVAL):
        first = await cluster.first_run(
            job.name, after=restart_at, newer_than=old_tokens[job.name], timeout_s=10
        )
        await cluster.until_runs(job.name, 5, since=first.start, timeout_s=10)
        await wait_saves(cluster, job.name, 10, since=first.start)
    events = cluster.events()
    for job in (RATE, INTERVAL):
        old = old_tokens[job.name]
        saves = saves_of(events, job.name)
        given = given_of(events, job.name)
        new = [g for g in given if g.token > old]
        new_saves = [s for s in saves if s.token > old]
        stale = [g for g in given if g.token <= old and g.t > restart_at]
        stale_answered = [s for s in saves if s.token <= old and s.ok and s.sent > restarted_at]
        before = last_answered(saves, restart_at)
        assert before is not None and new
        window = [r for r in cluster.runs(job.name) if r.start > restart_at - 1]
        record.add(
            "49b",
            f"redis-restart-empty-{job.kind}",
            restart_s=restarted_at - restart_at,
            new_term_after_s=new[0].t - restarted_at,
            last_saved_before=before.value,
            first_given_after=new[0].state,
            iteration_after=new[0].iteration,
            stale_term_runs=len(stale),
            stale_saves_answered=len(stale_answered),
            overlap_s=overlap_s(window),
            lost_in_new_term=lost_values(new, new_saves),
            repeated_in_new_term=len(repeated_values(new_saves)),
        )
        # Documented: without persistence the record goes with the lock. The next term starts
        # afresh, never from the state (or the record) of the term before the restart ...
        assert (new[0].state, new[0].iteration, new[0].cp_token) == (None, 1, None)
        assert all(g.cp_token is None or g.cp_token > old for g in new), new
        # ... and from then on resumes as usual, with no value lost or saved twice.
        assert bad_resumes(new, new_saves) == []
        assert lost_values(new, new_saves) == 0
        assert repeated_values(new_saves) == []
        # The stale term may run on until its next round (row 14's overlap), but nothing it
        # saves after the restart is stored.
        assert stale_answered == []
        # A stale term's runs stop at its lease deadline, reckoned from its last renewal,
        # which came before the restart: after it, its next round starts a new term.
        assert all(g.t <= restart_at + t.lease_s + TOL_S for g in stale), stale
        assert overlap_s(window) <= t.heartbeat + RATE.run_s + TOL_S


async def test_row49c_redis_restored_from_an_older_snapshot_rolls_the_state_back(
    cluster: Cluster, record: Results
) -> None:
    t = cluster.timing
    cluster.redis()  # no AOF, no automatic snapshot: the only RDB file is the SAVE below
    nodes = [cluster.replica(f"n{i}", [RATE]) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    await cluster.one_leader(RATE.name)
    await wait_saves(cluster, RATE.name, 10, since=0.0)
    store = cluster.store
    assert store is not None
    key = _keys.job_key(cluster.project, RATE.name, "checkpoint")
    with store.client() as client:
        before = int(client.hget(key, "state") or 0)
        client.save()  # blocking: the snapshot holds a state between the two reads
        after = int(client.hget(key, "state") or 0)
    saved_at = now()
    await wait_saves(cluster, RATE.name, 20, since=saved_at)
    await cluster.sleep(saved_at + 2 * t.lock_expiry - now())  # the snapshot's lock expires
    old = max(term.token for term in cluster.terms(RATE.name))
    killed_at = now()
    await asyncio.to_thread(store.kill)
    await asyncio.to_thread(store.restart, keep_data=True)  # loads the snapshot
    restarted_at = now()
    first = await cluster.first_run(RATE.name, after=killed_at, newer_than=old, timeout_s=10)
    await wait_saves(cluster, RATE.name, 10, since=first.start)
    events = cluster.events()
    saves = saves_of(events, RATE.name)
    given = given_of(events, RATE.name)
    successor = next(g for g in given if g.run == first.run)
    last = last_answered(saves, killed_at)
    assert last is not None
    rolled_back = last.value - (successor.state or 0)
    record.add(
        "49c",
        "redis-restored-from-older-rdb",
        snapshot_age_s=killed_at - saved_at,
        restart_s=restarted_at - killed_at,
        snapshot_state=[before, after],
        last_saved_before=last.value,
        first_given_after=successor.state,
        rolled_back=rolled_back,
        repeated_so_far=len(repeated_values(saves)),
        iteration_before=next(g for g in reversed(given) if g.t < killed_at).iteration,
        iteration_after=successor.iteration,
        overlap_s=overlap_s([r for r in cluster.runs(RATE.name) if r.start > killed_at - 1]),
    )
    # Known limit: the record is the snapshot's, written by the term before the restart
    # (its token), and every value saved since the snapshot is done again.
    assert successor.state is not None and before <= successor.state <= after
    assert successor.cp_token is not None and successor.cp_token <= old
    assert rolled_back >= 20
    redone = [s.value for s in saves if s.ok and s.token > old and s.value <= last.value]
    assert repeated_values(saves) == sorted(redone)  # the new term redoes them, one by one
    # The lock came back expired: row 14's overlap of a lost key, no more.
    window = [r for r in cluster.runs(RATE.name) if r.start > killed_at - 1]
    assert overlap_s(window) <= t.heartbeat + RATE.run_s + TOL_S


# -- row 50: the leader SIGKILLed while it saves state -----------------------------------------


@pytest.mark.parametrize("rep", reps(5))
async def test_row50_leader_killed_while_saving_state(
    cluster: Cluster, record: Results, rep: int
) -> None:
    t = cluster.timing
    job = SAVING.name
    cluster.redis()
    nodes = [cluster.replica(f"n{i}", [SAVING]) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    leader = await cluster.one_leader(job)
    await wait_saves(cluster, job, 50, since=0.0)
    victim = cluster.replica_of(leader)
    in_flight = await saving(cluster, job, leader)
    killed_at = victim.kill()
    assert await victim.wait_exit() == -signal.SIGKILL
    first = await cluster.first_run(
        job, after=killed_at, newer_than=in_flight.token, timeout_s=t.lock_expiry + 5
    )
    await wait_saves(cluster, job, 30, since=first.start)
    events = cluster.events()
    saves = saves_of(events, job)
    given = given_of(events, job)
    killed_run = next(g for g in given if g.run == in_flight.run)
    successor = next(g for g in given if g.run == first.run)
    last = last_answered(saves, killed_at)
    assert last is not None
    unanswered = [s for s in saves if s.run == in_flight.run and s.done is None]
    # Steps done again: values the successor saved that another run had sent before.
    redone = [
        s
        for s in saves
        if s.run == first.run
        and any(x.value == s.value and x.run != s.run and x.sent < s.sent for x in saves)
    ]
    store = cluster.store
    assert store is not None
    with store.client() as client:
        stored = client.hget(_keys.job_key(cluster.project, job, "checkpoint"), "state")
    record.add(
        "50",
        "sigkill-while-saving",
        killed_mid_save=bool(unanswered),
        takeover_s=first.start - killed_at,
        last_answered=last.value,
        in_flight=[s.value for s in unanswered],
        successor_given=successor.state,
        landed=successor.state != last.value,
        lost=lost_values(given, saves),
        repeated=len(repeated_values(saves)),
        redone_steps=len(redone),
        iteration_killed=killed_run.iteration,
        iteration_successor=successor.iteration,
        state_gap_s=state_gap_s(saves, killed_at),
    )
    assert max_concurrent(cluster.runs(job)) == 1
    # The successor resumes from the last value Redis answered, or from the one in flight if
    # Redis had written it before the kill: nothing answered is lost, and at most the one
    # step in flight is done again.
    assert successor.state in allowed_states(saves, successor.t)
    assert successor.state is not None and successor.state >= last.value
    assert successor.cp_token == killed_run.token  # the killed term wrote it last
    assert bad_resumes(given, saves) == []
    assert lost_values(given, saves) == 0
    assert repeated_values(saves) == []
    assert len(redone) <= 1
    # The killed run never wrote its record: the successor runs under the same number
    # (the documented SIGKILL window), or the next one if the kill came after the record.
    assert successor.iteration in (killed_run.iteration, killed_run.iteration + 1)
    assert t.lock_expiry - t.heartbeat - 0.05 <= first.start - killed_at
    assert first.start - killed_at <= t.lock_expiry + EVERY_S + TOL_S
    assert stored is not None and int(stored) >= max(s.value for s in saves if s.ok)
