"""Checkpoints (issue 12) in real replica processes on a real Redis.

The replicas are ``checkpoint_proc.py`` subprocesses (heartbeat 0.1 s, lock expiry 0.5 s unless
a test says otherwise) whose jobs journal every run: the state and checkpoint each run was
given, its term, and what became of its ``save_state``. Faults are real signals: SIGTERM (a
graceful stop), SIGKILL, SIGSTOP/SIGCONT. What is checked:

- the state and the cluster-wide iteration go on across a graceful handover, a SIGKILL and a
  whole fleet restarted, with nothing lost or done twice except in the one window that
  docs/checkpoints.md documents (a SIGKILL before the run's save or record);
- a stale leader's ``save_state`` raises ``LeadershipLost`` and leaves the stored state alone,
  both when its lease ran out while it was stopped and when Redis lost its lock under it (then
  only the fence inside Redis can refuse the write);
- failed and timed-out runs keep the iteration and the state (in-process, real Redis);
- a value that is not JSON, or too large, fails before any Redis traffic;
- each misfire policy after a fleet downtime that spans several cron instants;
- an interval job's new leader waits out ``every`` since the previous leader's last run.

The multi-process tests are marked ``slow`` (several seconds each, mostly interpreter
start-up); ``-m "not slow"`` leaves the two in-process ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import checkpoint_proc
import pytest
import redis.asyncio
from checkpoint_proc import (
    CATCH_UP_GRACE_S,
    COUNTER_JOB,
    CRON,
    CRON_EVERY_S,
    CRON_JOBS,
    EVERY_S,
    HEARTBEAT_S,
    LOCK_EXPIRY_S,
    SPACED_EVERY_S,
    SPACED_JOB,
    STALE_BODY_S,
    STALE_JOB,
    Run,
    now,
)
from process_fleet import EXIT_S, POLL_S, STARTUP_S, ProcessFleet
from servers import RedisServer, RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob import Checkpoint, ConfigurationError, Cron, JobContext, SingletonJobs
from fastapi_singletonjob._checkpoint import DEFAULT_MAX_STATE_BYTES
from fastapi_singletonjob._store import keys as _keys
from fastapi_singletonjob._store.redis import scripts as _scripts

pytestmark = pytest.mark.redis

T = TypeVar("T")

TAKEOVER_S = LOCK_EXPIRY_S + 4.0
PHASE_RUNS = 5
"""Runs each phase of the continuity test waits for before its next fault."""
LONG_LOCK_EXPIRY_S = 4.0
"""The stale test's lease when Redis loses the lock: the stopped leader's own view of its lease
(measured from its last renewal) must outlast the pause, the takeover and the new leader's
first save, so that only Redis can refuse its write."""
PAUSE_ATTEMPTS = 5
WALL_TOLERANCE_S = 0.005
"""Between two processes' wall clocks (the same clock) and the monotonic wait in between."""
SPACING_SLACK_S = 0.5
"""How much later than required the new leader's first run may start on a busy machine."""
GO_PHASE_S = 0.3
"""The downtime ends this long after a cron instant: the new replica leads well before the
next one, so every instant is either missed by the whole fleet or a regular tick."""


# --- replicas ------------------------------------------------------------------------------------


class Fleet(ProcessFleet):
    """The ``checkpoint_proc`` replicas of one test, all of one mode."""

    def __init__(
        self, url: str, project: str, workdir: Path, mode: str, lock_expiry_s: float = LOCK_EXPIRY_S
    ) -> None:
        super().__init__(workdir)
        self.url = url
        self.project = project
        self.mode = mode
        self.lock_expiry_s = lock_expiry_s

    def start(self, *nodes: str, wait_for: Path | None = None) -> None:
        for node in nodes:
            args = [
                *(sys.executable, checkpoint_proc.__file__, "--mode", self.mode),
                *("--url", self.url, "--project", self.project),
                *("--node", node, "--journal", str(self.journal_of(node))),
                *("--lock-expiry", str(self.lock_expiry_s)),
            ]
            if wait_for is not None:
                args += ["--wait-for", str(wait_for)]
            self.spawn(node, args)

    def runs(self, job: str | None = None) -> list[Run]:
        """Every node's runs (of ``job``, if given) in start order; fails the test when a
        replica exited that the test did not stop."""
        self.check_alive()
        runs = [
            run
            for replica in self.replicas.values()
            for run in checkpoint_proc.read_runs(replica.journal)
            if job is None or run.job == job
        ]
        return sorted(runs, key=lambda r: r.start)

    def rows(self, node: str, event: str) -> list[dict[str, Any]]:
        rows = checkpoint_proc.read_rows(self.replicas[node].journal)
        return [row for row in rows if row["event"] == event]

    def leader(self) -> str:
        """The node that ran last."""
        runs = self.runs()
        assert runs, "no run yet"
        return runs[-1].node

    async def wait_started(self, *nodes: str) -> float:
        """Wait until each of ``nodes`` has started its jobs; return when the last did."""
        await wait_until(
            lambda: all(self.rows(node, "started") for node in nodes) or self.exited(nodes),
            STARTUP_S,
            f"{', '.join(nodes)} started",
            poll_s=POLL_S,
        )
        self.check_alive()
        return max(float(self.rows(node, "started")[0]["mono"]) for node in nodes)

    async def stop_all(self, ready: Callable[[str], bool] | None = None) -> None:
        """SIGTERM every live replica once it has its handler ("loaded"), and check that each
        exits 0."""
        await super().stop_all(ready or (lambda node: bool(self.rows(node, "loaded"))))


FleetFactory = Callable[..., Fleet]


@pytest.fixture
async def fleets(
    redis_url: str, unique_project: str, tmp_path: Path
) -> AsyncIterator[FleetFactory]:
    """``fleets(mode, lock_expiry_s=...)``: a :class:`Fleet`, closed when the test ends."""
    made: list[Fleet] = []

    def make(mode: str, **options: Any) -> Fleet:
        fleet = Fleet(redis_url, unique_project, tmp_path, mode, **options)
        made.append(fleet)
        return fleet

    try:
        yield make
    finally:
        for fleet in made:
            fleet.close()


async def wait_for(get: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll ``get`` until it returns something other than None; return that."""
    found: list[T] = []

    def check() -> bool:
        value = get()
        if value is not None:
            found.append(value)
        return value is not None

    await wait_until(check, timeout_s, what, poll_s=POLL_S)
    return found[-1]


def reader(url: str, project: str, jobs: Sequence[str]) -> SingletonJobs:
    """Another replica, never started, that reads checkpoints as an operator would."""

    async def noop() -> None:
        return None

    replica = SingletonJobs(url, project=project, node_id="reader")
    for job in jobs:
        replica.fixed_rate(job, every=60.0)(noop)
    return replica


async def stored(url: str, project: str, job: str) -> Checkpoint:
    checkpoint = await reader(url, project, [job]).checkpoint(job)
    assert checkpoint is not None, f"job {job!r} has no checkpoint"
    return checkpoint


# --- the journal checks --------------------------------------------------------------------------


def continuity(runs: Sequence[Run], unsaved_ok: Sequence[Run]) -> tuple[list[str], int]:
    """Check that the state and the iteration go on from run to run (in start order): each run
    resumes from the value its predecessor saved and is numbered one more, except after a run
    in ``unsaved_ok`` (killed, or whose save was refused), which may be done again (same
    state, same iteration) or may have left its save (or record) behind. Fencing tokens never
    go down, and go up at each change of node. Returns the problems and the number of runs
    that resumed from the same state as their predecessor (work done twice)."""
    problems = []
    repeats = 0
    broken = {(run.node, run.start) for run in unsaved_ok}
    for run in runs:
        if run.iteration != (run.cp_iteration or 0) + 1:
            problems.append(f"ctx.iteration is not the stored one plus 1: {run.label()}")
    for before, run in itertools.pairwise(runs):
        assert before.n is not None and run.n is not None
        where = f"{before.label()} -> {run.label()}"
        if (before.node, before.start) in broken:
            if run.n not in (before.n, before.n + 1):
                problems.append(f"state lost or gone back after a broken run: {where}")
            if run.iteration not in (before.iteration, before.iteration + 1):
                problems.append(f"iteration lost after a broken run: {where}")
        else:
            if before.saved != before.n + 1:
                problems.append(f"a run that was not stopped did not save: {where}")
            if run.n != before.n + 1:
                problems.append(f"state gap or repeat: {where}")
            if run.iteration != before.iteration + 1:
                problems.append(f"iteration gap or repeat: {where}")
        repeats += run.n == before.n
        if run.token < before.token or (run.node != before.node and run.token == before.token):
            problems.append(f"fencing token did not go up: {where}")
    return problems, repeats


def handovers(runs: Sequence[Run]) -> list[str]:
    """The nodes in the order they ran, each listed once per stretch of runs."""
    order: list[str] = []
    for run in runs:
        if not order or order[-1] != run.node:
            order.append(run.node)
    return order


# --- 1. state continuity -------------------------------------------------------------------------


async def more_runs(
    fleet: Fleet, since: float, *, not_by: str | None = None, timeout_s: float = STARTUP_S
) -> None:
    """Wait until ``PHASE_RUNS`` runs have ended after ``since`` (on nodes other than
    ``not_by``)."""
    await wait_until(
        lambda: (
            sum(
                1
                for run in fleet.runs()
                if run.start > since and run.node != not_by and run.end is not None
            )
            >= PHASE_RUNS
        ),
        timeout_s,
        f"{PHASE_RUNS} runs after {since:.3f}" + (f" not by {not_by}" if not_by else ""),
        poll_s=POLL_S,
    )


@pytest.mark.slow
async def test_state_continues_across_sigterm_sigkill_and_a_fleet_restart(
    fleets: FleetFactory, redis_url: str, unique_project: str
) -> None:
    """Interval job every 50 ms that resumes from its state ``n`` and saves ``n + 1``, led in
    turn by n1/n2, the other, n3, n4/n5: (a) SIGTERM of the leader, (b) SIGKILL of the
    leader after its save and before its return, (c) the whole fleet stopped, then new
    processes. The saved values and ``ctx.iteration`` go on from run to run without a gap or
    a repeat; only after (b) may the iteration come again (the run's record is lost, its
    saved state is not)."""
    fleet = fleets("counter")
    fleet.start("n1", "n2")
    await fleet.wait_started("n1", "n2")
    await more_runs(fleet, 0.0)

    # (a) The leader stops gracefully: its run in flight ends and is recorded, then the other
    # node resumes from it. n3 joins, to be the standby of (b).
    graceful = fleet.leader()
    terminated_at = fleet.send(graceful, signal.SIGTERM)
    fleet.start("n3")
    assert await fleet.wait_exit(graceful) == 0, fleet.describe()
    await more_runs(fleet, terminated_at, not_by=graceful, timeout_s=TAKEOVER_S)
    await fleet.wait_started("n3")

    # (b) The leader is killed between its save and the end of its run, so that the run is
    # never recorded: the documented window.
    aimed = await wait_for(
        lambda: next((r for r in fleet.runs()[-1:] if r.saved is not None and r.end is None), None),
        TAKEOVER_S,
        "the leader between its save and its return",
    )
    killed = aimed.node
    killed_at = fleet.send(killed, signal.SIGKILL)
    assert await fleet.wait_exit(killed) == -signal.SIGKILL
    await more_runs(fleet, killed_at, not_by=killed, timeout_s=TAKEOVER_S)

    # (c) The whole fleet stops, and new processes start from what Redis holds.
    await fleet.stop_all()
    down_at = now()
    fleet.start("n4", "n5")
    await more_runs(fleet, down_at)
    await fleet.stop_all()

    runs = fleet.runs(COUNTER_JOB)
    killed_run = [run for run in runs if run.node == killed][-1]
    refused = [run for run in runs if run.lost is not None]
    problems, repeats = continuity(runs, [killed_run, *refused])
    order = handovers(runs)
    after_kill = runs[runs.index(killed_run) + 1]
    in_window = killed_run.saved is not None and killed_run.end is None
    print(
        f"{len(runs)} runs, leaders in turn: {' -> '.join(order)}; last run of the killed node "
        f"{killed}: {killed_run.label()} (killed after its save, before its return: "
        f"{in_window}); the next: {after_kill.label()}; state done twice: {repeats}; refused "
        f"saves: {len(refused)}"
    )
    assert not problems, "\n".join(problems)
    assert repeats <= 1 + len(refused)
    if in_window:  # else the SIGKILL came a little late: the checks above hold either way
        # The state it saved is kept, its record is lost: its iteration number comes again.
        assert (after_kill.n, after_kill.iteration) == (killed_run.saved, killed_run.iteration)
    assert runs[0].cp_iteration is None and (runs[0].n, runs[0].iteration) == (0, 1)
    # Every phase handed over: n1/n2 -> the other -> n3 -> n4/n5.
    assert len(order) >= 4 and order[-1] in ("n4", "n5"), order

    last = runs[-1]
    checkpoint = await stored(redis_url, unique_project, COUNTER_JOB)
    assert last.n is not None and checkpoint.state == last.n + 1
    assert checkpoint.iteration == last.iteration
    assert (checkpoint.node_id, checkpoint.fencing_token) == (last.node, last.token)
    assert checkpoint.last_outcome == "success" and checkpoint.last_error is None


# --- 2. a stale leader's save ------------------------------------------------------------------


async def pause_in_body(fleet: Fleet) -> Run:
    """SIGSTOP the leader while a run (not the job's first) is between reading its state and
    saving; return it."""
    for _ in range(PAUSE_ATTEMPTS):
        run = await wait_for(
            lambda: next(
                (
                    r
                    for r in reversed(fleet.runs())
                    if r.saving is None
                    and r.cp_iteration is not None
                    and now() - r.start < STALE_BODY_S / 2
                ),
                None,
            ),
            TAKEOVER_S,
            "a run in its body",
        )
        fleet.pause(run.node)
        [current] = [r for r in fleet.runs() if (r.node, r.start) == (run.node, run.start)]
        if current.saving is None:
            return current
        fleet.resume(run.node)  # it got to its save before the stop: try the next run
    raise AssertionError(f"could not stop a run in its body in {PAUSE_ATTEMPTS} attempts")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["lease-expired", "lock-lost-in-redis"])
async def test_a_stale_leaders_save_state_is_refused(
    how: str, fleets: FleetFactory, redis_server: RedisServer, unique_project: str
) -> None:
    """The leader is stopped (SIGSTOP) between reading its state and saving. Another replica
    takes over and saves; then the old one wakes and calls ``save_state``: it must raise
    ``LeadershipLost``, and the stored state stays the new leader's.

    ``lease-expired``: the old leader stays stopped past its lease, so it can tell on waking
    that its term is over. ``lock-lost-in-redis``: Redis loses the lock while it is stopped
    (DEL, as a failover that lost the latest writes, or an operator) and its lease is long, so
    it wakes believing it still leads; only the fence inside Redis can refuse the write.
    """
    lock_lost = how == "lock-lost-in-redis"
    fleet = fleets("stale", lock_expiry_s=LONG_LOCK_EXPIRY_S if lock_lost else LOCK_EXPIRY_S)
    fleet.start("n1", "n2")
    await fleet.wait_started("n1", "n2")
    stale = await pause_in_body(fleet)
    old = stale.node
    new = "n2" if old == "n1" else "n1"
    if lock_lost:
        with redis_server.client() as client:
            assert client.delete(_keys.job_key(unique_project, STALE_JOB, "lock")) == 1

    takeover = await wait_for(
        lambda: next(
            (
                r
                for r in fleet.runs()
                if r.node == new and r.start > stale.start and r.saved is not None
            ),
            None,
        ),
        TAKEOVER_S,
        f"{new} takes over and saves",
    )
    fleet.resume(old)
    woken = await wait_for(
        lambda: next(
            (
                r
                for r in fleet.runs()
                if (r.node, r.start) == (old, stale.start)
                and (r.lost is not None or r.saved is not None)
            ),
            None,
        ),
        EXIT_S,
        f"{old} tries to save after waking",
    )
    assert woken.lost is not None, f"the stale leader's save was accepted: {woken.label()}"
    refused_at = float(woken.lost["mono"])
    await wait_until(
        lambda: any(
            r.node == new and r.saved_at is not None and r.saved_at > refused_at
            for r in fleet.runs()
        ),
        TAKEOVER_S,
        f"{new} saves again",
        poll_s=POLL_S,
    )
    stopping_at = now()
    await fleet.stop_all()

    runs = fleet.runs(STALE_JOB)
    print(
        f"{how}: {old} (token {stale.token}) stopped in its run; {new} took over with token "
        f"{takeover.token}; the stale save was refused: {woken.lost['error']}"
    )
    assert woken.saved is None and "not saved" in woken.lost["error"]
    if lock_lost:
        assert woken.leader_at_save is True, "the stale leader knew it had lost; not a fence test"
    # The record right after the refusal holds the new leader's state ...
    assert woken.lost["stored_node"] == new
    assert woken.lost["stored_token"] == takeover.token > stale.token
    assert isinstance(woken.lost["stored_state"], int)
    assert stale.n is not None and woken.lost["stored_state"] >= stale.n + 1
    # ... and the new leader did not overwrite it meanwhile (which would hide a stale write).
    assert woken.saving is not None
    assert not [
        r
        for r in runs
        if r.node == new and r.saved_at is not None and woken.saving <= r.saved_at <= refused_at
    ], "the new leader saved while the stale one did: the check above proves nothing"
    # The stale run is the only one done twice: the new leader resumed from what it read.
    assert not [r for r in runs if r.node == old and stale.start < r.start < stopping_at]
    problems, repeats = continuity(runs, [woken])
    assert not problems, "\n".join(problems)
    assert repeats == 1
    first_new = next(r for r in runs if r.node == new and r.start > stale.start)
    assert (first_new.n, first_new.iteration) == (stale.n, stale.iteration)
    # ... from the record as the stale run found it (which never recorded itself).
    assert stale.cp_node == old and stale.cp_token == stale.token
    assert (first_new.cp_node, first_new.cp_token, first_new.cp_iteration) == (
        old,
        stale.token,
        stale.cp_iteration,
    )

    last = runs[-1]
    checkpoint = await stored(fleet.url, unique_project, STALE_JOB)
    assert (checkpoint.node_id, checkpoint.fencing_token) == (new, takeover.token)
    assert last.n is not None and checkpoint.state == last.n + 1
    assert checkpoint.iteration == last.iteration


# --- 3. failed runs (in-process, real Redis) -----------------------------------------------------


async def test_failed_runs_keep_iteration_and_state(redis_url: str, unique_project: str) -> None:
    """Runs 2-5 fail (an exception; a save, then an exception; a timeout): each is recorded
    with its outcome and error, and none changes the iteration; only ``save_state`` changes
    the state, even in a run that then fails."""
    jobs = SingletonJobs(
        redis_url,
        project=unique_project,
        node_id="solo",
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
        shutdown_timeout=1.0,
    )
    seen: list[JobContext] = []

    @jobs.interval("flaky", every=EVERY_S, timeout=0.2)
    async def flaky(ctx: JobContext) -> None:
        seen.append(ctx)
        call = len(seen)
        if call == 1:
            await ctx.save_state({"cursor": 1})
        elif call == 2:
            raise ValueError("boom 2")
        elif call == 3:
            await ctx.save_state({"cursor": 3})  # durable, though the run then fails
            raise RuntimeError("boom 3")
        elif call == 4:
            await asyncio.sleep(60)  # cut by the timeout

    async with jobs:
        await wait_until(lambda: len(seen) >= 6, 10.0, "six runs")

    def given(call: int) -> tuple[object, ...]:
        ctx = seen[call - 1]
        cp = ctx.checkpoint
        assert cp is not None, f"run {call} had no checkpoint"
        return ctx.iteration, cp.iteration, cp.state, cp.last_outcome, cp.last_error

    assert seen[0].iteration == 1 and seen[0].checkpoint is None
    assert given(2) == (2, 1, {"cursor": 1}, "success", None)
    assert given(3) == (2, 1, {"cursor": 1}, "failed", "ValueError: boom 2")
    assert given(4) == (2, 1, {"cursor": 3}, "failed", "RuntimeError: boom 3")
    assert given(5)[:4] == (2, 1, {"cursor": 3}, "timeout")
    assert given(6) == (3, 2, {"cursor": 3}, "success", None)
    assert len({ctx.fencing_token for ctx in seen}) == 1

    # Another replica reads the same record: runs 1, 5, 6, ... succeeded.
    checkpoint = await stored(redis_url, unique_project, "flaky")
    assert checkpoint.iteration == len(seen) - 3
    assert (checkpoint.state, checkpoint.last_outcome) == ({"cursor": 3}, "success")
    assert checkpoint.node_id == "solo"


# --- 4. bad values -------------------------------------------------------------------------------

INSPECTOR = "test-inspector"


def _text(value: object) -> str:
    # redis-py leaves SLOWLOG GET's fields as bytes, whatever decode_responses says.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _library_commands(entries: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The commands (name in capitals, then the arguments) of SLOWLOG entries sent by anyone
    but the test's inspector connection, oldest first. Redis 7 also logs the commands a script
    runs, each before the script's own EVALSHA."""
    commands = []
    for entry in reversed(entries):
        if _text(entry.get("client_name", "")) != INSPECTOR:
            name, *args = _text(entry["command"]).split(" ")
            commands.append((name.upper(), *args))
    return commands


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()  # as redis-py's Script names it


WRITES = {"HSET", "HINCRBY", "HDEL", "DEL", "EVAL", "SCRIPT"}
"""What would change the record, or run an unnamed script (``PEXPIRE`` is ``ELECT``'s)."""


async def test_bad_states_fail_before_any_redis_traffic(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    """With the election running, ``INFO commandstats`` cannot tell a ``SAVE_STATE`` from an
    ``ELECT`` (both ``EVALSHA``); the slow log with a threshold of 0 lists every command with
    its arguments, the script's SHA among them."""
    server = fresh_redis()
    with server.client() as admin:
        admin.config_set("slowlog-log-slower-than", 0)
        admin.config_set("slowlog-max-len", 10_000)
    jobs = SingletonJobs(
        server.url,
        project=unique_project,
        node_id="solo",
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
    )
    limit = DEFAULT_MAX_STATE_BYTES
    errors: list[str] = []
    log: dict[str, list[tuple[str, ...]]] = {}
    done = asyncio.Event()

    @jobs.interval("export", every=60.0)
    async def export(ctx: JobContext) -> None:
        inspector = redis.asyncio.Redis.from_url(
            server.url, decode_responses=True, client_name=INSPECTOR
        )
        try:
            await ctx.save_state("warm-up")  # loads the script: later saves are one EVALSHA
            await inspector.slowlog_reset()
            for bad in ({1, 2}, "x" * (limit - 1)):  # a set; limit + 1 bytes of JSON text
                try:
                    await ctx.save_state(bad)
                except ConfigurationError as exc:
                    errors.append(str(exc))
            window = await inspector.slowlog_get(10_000)
            log["bad"] = _library_commands(window)
            await ctx.save_state("x" * (limit - 2))  # exactly the limit: accepted
            seen = max((e["id"] for e in window), default=-1)
            newer = [e for e in await inspector.slowlog_get(10_000) if e["id"] > seen]
            log["good"] = _library_commands(newer)
        finally:
            await inspector.aclose()
            done.set()

    async with jobs:
        await asyncio.wait_for(done.wait(), 10.0)
        checkpoint = await jobs.checkpoint("export")

    save_sha, elect_sha = _sha(_scripts.SAVE_STATE), _sha(_scripts.ELECT)
    bad = log["bad"]
    print(f"library commands while saving the bad values: {[c[0] for c in bad]}")
    assert len(errors) == 2, errors
    assert "of type set" in errors[0]
    assert f"{limit + 1} bytes" in errors[1] and f"limit of {limit} bytes" in errors[1]
    # Meanwhile at most election rounds went to Redis: no SAVE_STATE, no write to the record.
    assert all(c[:2] == ("EVALSHA", elect_sha) for c in bad if c[0] == "EVALSHA"), bad
    assert not [c for c in bad if c[0] in WRITES], bad
    # The same lens sees a good save: one EVALSHA of SAVE_STATE, which writes the state.
    good = log["good"]
    assert [c[:2] for c in good if c[0] == "EVALSHA" and c[1] != elect_sha] == [
        ("EVALSHA", save_sha)
    ], good
    assert [c[2] for c in good if c[0] == "HSET"] == ["state"], good
    assert checkpoint is not None and checkpoint.state == "x" * (limit - 2)


# --- 5. misfire policies -------------------------------------------------------------------------


def instants(after: float, until: float) -> list[float]:
    """The cron instants ``t`` with ``after < t <= until`` (Unix seconds)."""
    schedule = Cron(CRON)
    found = []
    instant = schedule.next_fire(datetime.fromtimestamp(after, UTC))
    while instant is not None and instant.timestamp() <= until:
        found.append(instant.timestamp())
        instant = schedule.next_fire(instant)
    return found


@pytest.mark.slow
async def test_misfire_policies_after_a_fleet_downtime(
    fleets: FleetFactory, redis_url: str, unique_project: str, tmp_path: Path
) -> None:
    """Replica ``a`` runs the three cron jobs (every 2 s) until each has recorded a run, then
    stops; for ~4 s no replica runs (two instants missed), then replica ``b`` starts. ``b``
    was launched at the beginning and waits for a file before it starts its jobs, so the end
    of the downtime is chosen to the millisecond, not by interpreter start-up."""
    fleet = fleets("cron")
    go = tmp_path / "go"
    fleet.start("a")
    fleet.start("b", wait_for=go)
    operator = reader(redis_url, unique_project, list(CRON_JOBS))

    async def all_recorded() -> bool:
        return all([await operator.checkpoint(job) is not None for job in CRON_JOBS])

    await wait_until(lambda: bool(fleet.rows("b", "loaded")), STARTUP_S, "b loaded", poll_s=POLL_S)
    await wait_until(all_recorded, STARTUP_S + 2 * CRON_EVERY_S, "a run of each job", poll_s=0.1)
    fleet.send("a", signal.SIGTERM)
    assert await fleet.wait_exit("a") == 0, fleet.describe()

    last: dict[str, float] = {}
    for job in CRON_JOBS:
        checkpoint = await operator.checkpoint(job)
        assert checkpoint is not None and checkpoint.last_scheduled_at is not None
        last[job] = checkpoint.last_scheduled_at.timestamp()
    go_at = max(last.values()) + 2 * CRON_EVERY_S + GO_PHASE_S
    next_regular = instants(go_at, go_at + CRON_EVERY_S)[0]
    await wait_until(
        lambda: time.time() >= go_at, go_at - time.time() + 1.0, "the end of the downtime"
    )
    go.touch()
    await fleet.wait_started("b")

    def caught_up_to_next_regular() -> bool:
        runs = [r for r in fleet.runs() if r.node == "b" and r.end is not None]
        return all(
            any(r.job == job and r.scheduled >= next_regular for r in runs) for job in CRON_JOBS
        )

    await wait_until(
        caught_up_to_next_regular,
        next_regular - time.time() + CRON_EVERY_S + 3.0,
        f"b runs each job's instant {next_regular}",
        poll_s=0.02,
    )
    await fleet.stop_all()

    # Every missed instant is still within catch_up's grace when b starts.
    assert go_at - min(last.values()) < CATCH_UP_GRACE_S
    [started] = fleet.rows("b", "started")
    print(f"b started {started['wall'] - go_at:.3f}s after the end of the downtime")
    for job, policy in CRON_JOBS.items():
        runs = fleet.runs(job)
        twice = [t for t, k in Counter(r.scheduled for r in runs).items() if k > 1]
        assert not twice, f"{job}: instants run twice: {twice}"
        by_a = [r for r in runs if r.node == "a"]
        by_b = [r for r in runs if r.node == "b"]
        assert by_a and by_a[-1].scheduled == max(r.scheduled for r in by_a) == last[job]
        missed = instants(last[job], go_at)
        late = [r.scheduled for r in by_b if r.scheduled <= go_at]  # in start order
        regular = [r.scheduled for r in by_b if r.scheduled > go_at]
        print(
            f"{job} (misfire={policy!r}): missed {[round(t) % 100 for t in missed]} "
            f"(seconds mod 100), b ran {[round(t) % 100 for t in late]} of them, then "
            f"{[round(t) % 100 for t in regular]}"
        )
        assert len(missed) >= 2, (last[job], go_at)
        expected = {"skip": [], "run_once": missed[-1:], "catch_up": missed}[policy]
        assert late == expected, f"{job}: b ran {late} of the missed {missed}"
        assert all(r.started_at < next_regular for r in by_b if r.scheduled <= go_at)
        # Then the regular ticks, from the first one after b started: b led in time.
        assert regular == instants(go_at, regular[-1]), (job, regular, go_at)
        assert regular[0] == next_regular, f"{job}: b was not leading by {next_regular}"
        # The cluster-wide iteration goes on from a's last recorded run.
        assert by_b[0].cp_scheduled == last[job] and by_b[0].cp_node == "a"
        assert [r.iteration for r in runs] == list(range(1, len(runs) + 1)), job


# --- 6. interval spacing across leaders --------------------------------------------------------


@pytest.mark.slow
async def test_a_new_leader_waits_out_the_interval(fleets: FleetFactory) -> None:
    """Interval job every 1 s; its leader stops gracefully right after a run. The other
    replica takes over within a few tens of ms, and must still start its first run no earlier
    than the stored ``last_completed_at`` plus 1 s."""
    fleet = fleets("spaced")
    fleet.start("n1", "n2")
    both_at = await fleet.wait_started("n1", "n2")
    ended = await wait_for(
        lambda: next(
            (r for r in reversed(fleet.runs()) if r.start > both_at and r.end is not None), None
        ),
        SPACED_EVERY_S + STARTUP_S,
        "a run after both replicas started",
    )
    old = ended.node
    new = "n2" if old == "n1" else "n1"
    terminated_at = fleet.send(old, signal.SIGTERM)
    assert await fleet.wait_exit(old) == 0, fleet.describe()
    first = await wait_for(
        lambda: next((r for r in fleet.runs() if r.node == new and r.start > terminated_at), None),
        SPACED_EVERY_S + TAKEOVER_S,
        f"{new}'s first run",
    )
    await fleet.stop_all()

    last_old = [r for r in fleet.runs(SPACED_JOB) if r.node == old][-1]
    assert last_old.start == ended.start, "the old leader ran again before its SIGTERM"
    assert last_old.end_wall is not None and first.cp_completed is not None
    waited_s = first.started_at - first.cp_completed
    print(
        f"{old} got SIGTERM {(terminated_at - ended.start) * 1000:.0f} ms after its run began; "
        f"{new} started its first run {waited_s:.3f}s after the stored last_completed_at"
    )
    assert (first.cp_node, first.cp_token) == (old, last_old.token)
    assert first.cp_completed >= last_old.end_wall  # recorded after the function returned
    assert waited_s >= SPACED_EVERY_S - WALL_TOLERANCE_S
    assert waited_s <= SPACED_EVERY_S + SPACING_SLACK_S
    assert f"node {new} runs it in" in fleet.log(new), "the new leader was not put off"
    assert first.iteration == last_old.iteration + 1
