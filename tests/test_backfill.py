"""The instants no node ran, recorded by the next leader (issue 30, item 1): when a leader is
killed, its successor finds from the schedule the instants between where the history stands
and its own term, and records them ("no leader"; "misfire skipped" for a cron or custom job
whose misfire policy did not run them), bounded, with the term's next record. On a fake
clock with the memory store; the real-Redis, real-process test is in
test_history_processes.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from itertools import pairwise

import pytest
from fake_nodes import kill, stop
from test_runner import START, Factory, clock, make

from fastapi_singletonjob import DropReason, HistoryEntry, Occurrence, SingletonJobs
from fastapi_singletonjob._checkpoint import FinishedRun, Recorded
from fastapi_singletonjob._history import cursor_of, next_mark
from fastapi_singletonjob._run.misfire import Missed, gap, gap_budget, interval_gap
from fastapi_singletonjob._schedule import Cron, FixedRate
from fastapi_singletonjob.testing import FakeClock

__all__ = ["clock", "make"]

NO_LEADER = DropReason.NO_LEADER.value
SKIPPED = DropReason.MISFIRE_SKIPPED.value


def at(seconds: float) -> datetime:
    return START + timedelta(seconds=seconds)


async def oldest_first(jobs: SingletonJobs, name: str) -> list[Occurrence]:
    return list(reversed(await jobs.history(name)))


async def failover(
    make: Factory,
    clock: FakeClock,
    define: object,
    run_s: float,
    *,
    paused: str | None = None,
    wait_s: float = 8.0,
) -> SingletonJobs:
    """Node a leads from START for ``run_s``, is killed; b, started with it, takes over once
    a's lease has expired (3 s) and leads until ``wait_s`` after the kill. Returns b. With
    ``paused``, a pauses that job a second before it is killed (b's term begins paused)."""
    a, b = make("a"), make("b")
    for jobs in (a, b):
        define(jobs)  # type: ignore[operator]
    await a.start()
    await clock.advance(0.01)
    await b.start()
    await clock.advance(run_s)
    if paused is not None:
        await a.pause(paused)
        await clock.advance(1.0)
    kill(a)
    await clock.advance(wait_s)
    return b


# -- fixed rate -------------------------------------------------------------------------


async def test_a_fixed_rate_gap_is_recorded_as_no_leader_every_instant_once(
    make: Factory, clock: FakeClock
) -> None:
    """a runs a 1 s grid, is killed; b takes over when the lease expires: the instants of
    the lease wait are "no leader" entries, written by b's term, and every instant from the
    first to the last is in the history exactly once, in order."""

    def define(jobs: SingletonJobs) -> None:
        @jobs.fixed_rate("tick", every=1.0)
        async def tick() -> None:
            pass

    b = await failover(make, clock, define, 3.5)
    entries = await oldest_first(b, "tick")
    gap_entries = [e for e in entries if e.missed]
    assert gap_entries and all(e.reason == NO_LEADER for e in gap_entries), entries
    assert {e.node_id for e in gap_entries} == {"b"}
    b_token = max(e.fencing_token for e in entries)
    assert all(e.fencing_token == b_token for e in gap_entries)
    seen = [e.scheduled_at for e in entries]
    assert seen == sorted(seen) and len(seen) == len(set(seen)), seen
    assert all(later - earlier == timedelta(seconds=1) for earlier, later in pairwise(seen))
    assert [e.node_id for e in entries if not e.missed][0] == "a"
    assert b.status("tick").jobs[0].dropped[DropReason.NO_LEADER] == len(gap_entries)


async def test_a_graceful_handover_leaves_no_gap(make: Factory, clock: FakeClock) -> None:
    a, b = make("a"), make("b")
    for jobs in (a, b):

        @jobs.fixed_rate("tick", every=1.0)
        async def tick() -> None:
            pass

    await a.start()
    await clock.advance(0.01)
    await b.start()
    await clock.advance(3.5)
    await stop(a, clock)
    await clock.advance(3.0)
    entries = await oldest_first(b, "tick")
    assert not [e for e in entries if e.missed], entries
    assert {e.node_id for e in entries} == {"a", "b"}


async def test_no_gap_on_a_jobs_first_term_nor_after_a_reset(
    make: Factory, clock: FakeClock
) -> None:
    """A first term has no checkpoint to start from; a reset deletes it: in neither case
    does the new leader record instants it knows nothing about."""

    def define(jobs: SingletonJobs) -> None:
        @jobs.fixed_rate("tick", every=1.0)
        async def tick() -> None:
            pass

    await clock.advance(5.0)  # instants before any node: none recorded
    a = make("a")
    define(a)
    await a.start()
    await clock.advance(2.5)
    assert not [e for e in await a.history("tick") if e.missed]
    kill(a)
    b = make("b")
    define(b)
    await b.reset_checkpoint("tick")
    await b.start()
    await clock.advance(6.0)
    assert not [e for e in await b.history("tick") if e.missed]


async def test_a_long_gap_is_bounded_with_a_count(make: Factory, clock: FakeClock) -> None:
    """history=6: a gap adds at most 3 entries (half), the oldest counting the rest, and
    the counts add up to every instant of the wait."""

    def define(jobs: SingletonJobs) -> None:
        @jobs.fixed_rate("tick", every=0.25, history=6)
        async def tick() -> None:
            pass

    b = await failover(make, clock, define, 1.0)
    [job] = b.status("tick").jobs
    gap_count = job.dropped[DropReason.NO_LEADER]
    assert gap_count >= 6, gap_count  # a lease wait of 2 s or more at 4 instants a second
    # b's term wrote the summary, two single instants and its first run in one call; the
    # history keeps 6 entries, so the summary was the first to go as b's runs came.
    written = await b.engine.store.read_history("tick", limit=6)  # type: ignore[union-attr]
    assert len(written) == 6
    for entry in written:
        assert entry.node_id == "b"
    missed = [e for e in written if e.missed]
    assert len(missed) <= 3, written


async def test_a_gap_entry_that_counts_stays_while_the_history_has_room(
    make: Factory, clock: FakeClock
) -> None:
    def define(jobs: SingletonJobs) -> None:
        @jobs.fixed_rate("tick", every=0.25, history=8)
        async def tick() -> None:
            pass

    a, b = make("a"), make("b")
    for jobs in (a, b):
        define(jobs)
    await a.start()
    await clock.advance(0.01)
    await b.start()
    await clock.advance(1.0)
    kill(a)
    for _ in range(200):  # until b has taken over and run twice (its takeover is jittered)
        await clock.advance(0.05)
        if b.status("tick").jobs[0].runs >= 2:
            break
    entries = await oldest_first(b, "tick")
    missed = [e for e in entries if e.missed]
    [job] = b.status("tick").jobs
    gap_count = job.dropped[DropReason.NO_LEADER]
    assert len(missed) == 4 and gap_count > 4, entries
    summary, *single = missed
    assert summary.count == gap_count - 3 and summary.last_at is not None
    assert (summary.last_at - summary.scheduled_at) == timedelta(seconds=0.25) * (summary.count - 1)
    assert [e.count for e in single] == [1, 1, 1]
    assert single[0].scheduled_at - summary.last_at == timedelta(seconds=0.25)


# -- interval ---------------------------------------------------------------------------


async def test_an_interval_gap_is_counted_from_the_last_runs_end(
    make: Factory, clock: FakeClock
) -> None:
    """An interval job's instants are the starts its runs would have had, ``every`` apart
    from the last recorded run's end; the new leader's first run stands for the last of
    them, the ones before are "no leader"."""

    def define(jobs: SingletonJobs) -> None:
        @jobs.interval("beat", every=1.0)
        async def beat() -> None:
            await jobs.clock.sleep(0.2)

    b = await failover(make, clock, define, 3.0)
    entries = await oldest_first(b, "beat")
    missed = [e for e in entries if e.missed]
    assert missed and all(e.reason == NO_LEADER and e.node_id == "b" for e in missed), entries
    last_a = max(
        (e for e in entries if not e.missed and e.node_id == "a"), key=lambda e: e.scheduled_at
    )
    first_b = min(
        (e for e in entries if not e.missed and e.node_id == "b"), key=lambda e: e.scheduled_at
    )
    assert all(last_a.scheduled_at < e.scheduled_at < first_b.scheduled_at for e in missed)
    spacing = [b2.scheduled_at - b1.scheduled_at for b1, b2 in pairwise(missed)]
    assert all(step == timedelta(seconds=1) for step in spacing), spacing
    assert first_b.scheduled_at - missed[-1].scheduled_at >= timedelta(seconds=1)


# -- cron and custom schedules ----------------------------------------------------------


@pytest.mark.parametrize("misfire", ["skip", "run_once", "catch_up"])
async def test_a_cron_gap_is_misfire_skipped_and_caught_up_instants_are_runs(
    make: Factory, clock: FakeClock, misfire: str
) -> None:
    """A per-second cron job: the instants of the lease wait that the new leader runs
    (run_once: the latest; catch_up: those within misfire_grace) are runs, the others
    "misfire skipped"; no instant is in the history twice, and none is left out."""

    def define(jobs: SingletonJobs) -> None:
        grace = 1.0 if misfire == "catch_up" else None

        @jobs.cron("sec", "* * * * * *", misfire=misfire, misfire_grace=grace)  # type: ignore[arg-type]
        async def sec() -> None:
            pass

    b = await failover(make, clock, define, 3.5)
    entries = await oldest_first(b, "sec")
    covered = [
        entry.scheduled_at + timedelta(seconds=k)
        for entry in entries
        for k in range(entry.count or 1)
    ]
    assert len(covered) == len(set(covered)), entries
    whole = {min(covered) + timedelta(seconds=k) for k in range(len(covered))}
    assert set(covered) == whole, sorted(whole - set(covered))
    missed = [e for e in entries if e.missed]
    assert missed and all(e.reason == SKIPPED for e in missed), entries
    b_runs = [e for e in entries if not e.missed and e.node_id == "b"]
    caught_up = [e for e in b_runs if e.scheduled_at < min(m.scheduled_at for m in missed)]
    if misfire == "skip":
        assert not [e for e in b_runs if e.scheduled_at < max(m.scheduled_at for m in missed)]
    else:
        assert b_runs and not caught_up, "the instants it runs come after those it skipped"


class EveryTwoSeconds:
    """A custom schedule: even seconds since the epoch."""

    def next_fire(self, after: datetime) -> datetime:
        return FixedRate(2.0).next_fire(after)


async def test_a_custom_schedule_gap_is_recorded(make: Factory, clock: FakeClock) -> None:
    """A custom schedule's instants are its ``next_fire``'s; with misfire="skip" the
    new leader runs none of them."""

    def define(jobs: SingletonJobs) -> None:
        @jobs.schedule("custom", EveryTwoSeconds(), misfire="skip")
        async def custom() -> None:
            pass

    b = await failover(make, clock, define, 3.5)
    entries = await oldest_first(b, "custom")
    seen = [e.scheduled_at for e in entries]
    assert len(seen) == len(set(seen)) and seen == sorted(seen), entries
    assert [e.reason for e in entries if e.missed] == [SKIPPED] * len(
        [e for e in entries if e.missed]
    )
    assert [e for e in entries if e.missed], entries
    assert all(b2 - b1 == timedelta(seconds=2) for b1, b2 in pairwise(seen)), seen


# -- the pure gap -----------------------------------------------------------------------


def test_gap_lists_each_instant_within_the_budget() -> None:
    grid = FixedRate(1.0)
    assert gap(grid, after=at(0), before=at(4), budget=5) == [Missed(at(k)) for k in (1, 2, 3)]
    assert gap(grid, after=at(0), before=at(1), budget=5) == []
    assert gap(grid, after=at(3), before=at(1), budget=5) == []


def test_a_longer_gap_keeps_the_latest_and_counts_the_rest() -> None:
    grid = FixedRate(1.0)
    entries = gap(grid, after=at(0), before=at(11), budget=3)  # instants 1..10
    assert entries == [Missed(at(1), 8, at(8)), Missed(at(9)), Missed(at(10))]
    assert gap(grid, after=at(0), before=at(11), budget=1) == [Missed(at(1), 10, at(10))]


def test_a_gap_too_long_to_walk_is_counted_exactly_on_a_grid() -> None:
    grid = FixedRate(1.0)
    entries = gap(grid, after=at(0), before=at(100_001), budget=4)
    assert entries == [
        Missed(at(1), 99_997, at(99_997)),
        Missed(at(99_998)),
        Missed(at(99_999)),
        Missed(at(100_000)),
    ]


def test_a_cron_gap_too_long_to_count_says_more() -> None:
    cron = Cron("* * * * * *")
    entries = gap(cron, after=at(0), before=at(5_001), budget=3)
    assert entries[0].first == at(1) and entries[0].count == 0
    assert entries[1:] == [Missed(at(4_999)), Missed(at(5_000))]
    assert entries[0].last == at(4_998)


def test_the_budget_is_half_the_history_at_most_50() -> None:
    assert [gap_budget(n) for n in (1, 2, 6, 100, 10_000)] == [1, 1, 3, 50, 50]


def test_an_interval_gap_is_on_the_last_runs_grid() -> None:
    last = at(10.3)
    entries = interval_gap(1.0, last_completed_at=last, after=at(9), now=at(14.0), budget=10)
    # Starts at 11.3, 12.3 and 13.3; the run at 14.0 stands for 13.3.
    assert entries == [Missed(at(11.3)), Missed(at(12.3))]
    # Where the history stands already (a paused instant at 12.3): only what comes after.
    assert interval_gap(1.0, last_completed_at=last, after=at(12.3), now=at(14.0), budget=10) == []


async def test_instants_that_come_during_a_catch_up_are_the_catch_ups(
    make: Factory, clock: FakeClock
) -> None:
    """misfire="catch_up" runs, in order, every instant that has come, those that come while
    it runs too: the timer leaves them to it (no "overlap" entry for an instant it then
    runs), so each instant is in the history once."""

    def define(jobs: SingletonJobs) -> None:
        @jobs.cron("sec", "* * * * * *", misfire="catch_up", misfire_grace=60)
        async def sec() -> None:
            await jobs.clock.sleep(0.6)

    b = await failover(make, clock, define, 3.5)
    entries = await oldest_first(b, "sec")
    seen = [e.scheduled_at for e in entries]
    assert len(seen) == len(set(seen)), [(e.scheduled_at, e.reason or e.outcome) for e in entries]
    assert not [e for e in entries if e.missed and e.node_id == "b"], entries


async def test_a_gap_before_a_paused_term_is_recorded_when_it_resumes(
    make: Factory, clock: FakeClock
) -> None:
    """a's job is paused when a is killed: b's term begins paused (no run, no checkpoint
    read); the instants of the lease wait are recorded once b runs again, after its own
    paused entries, and no instant is in the history twice."""

    def define(jobs: SingletonJobs) -> None:
        @jobs.fixed_rate("tick", every=1.0)
        async def tick() -> None:
            pass

    b = await failover(make, clock, define, 2.5, paused="tick", wait_s=7.0)
    while_paused = await oldest_first(b, "tick")
    assert {e.reason for e in while_paused if e.missed} == {DropReason.PAUSED.value}
    await b.resume("tick")
    await clock.advance(2.5)
    entries = await oldest_first(b, "tick")
    seen = [e.scheduled_at for e in entries]
    assert len(seen) == len(set(seen)), entries
    steps = {later - earlier for earlier, later in pairwise(sorted(seen))}
    assert steps == {timedelta(seconds=1)}, sorted(seen)
    gap_entries = [e for e in entries if e.reason == NO_LEADER]
    assert gap_entries and {e.node_id for e in gap_entries} == {"b"}, entries


async def test_the_gap_goes_in_the_call_of_the_terms_first_record(
    make: Factory, clock: FakeClock
) -> None:
    """No call of its own: the gap's entries are written by the record call of b's first
    run, before it (and so the number of record calls is one per turn of records, as it is
    without a gap)."""
    a, b = make("a"), make("b")
    for jobs in (a, b):

        @jobs.fixed_rate("tick", every=1.0)
        async def tick() -> None:
            await clock.sleep(0.3)  # its record goes a while after the checkpoint's read

    await a.start()
    await clock.advance(0.01)
    await b.start()
    store = b.engine.store  # type: ignore[union-attr]
    calls: list[list[FinishedRun]] = []
    record_runs = store.record_runs

    async def spy(runs: Sequence[FinishedRun], **kwargs: float) -> Recorded:
        calls.append(list(runs))
        return await record_runs(runs, **kwargs)

    store.record_runs = spy  # type: ignore[method-assign]
    await clock.advance(2.5)
    kill(a)
    await clock.advance(6.0)
    [with_gap] = [batch for batch in calls if any(run.missed for run in batch)]
    kinds = [run.missed or "run" for run in with_gap]
    assert kinds[-1] == "run" and set(kinds[:-1]) == {NO_LEADER}, kinds
    assert all(len(batch) == 1 for batch in calls if batch is not with_gap)


async def test_an_interval_gap_stops_at_the_terms_own_paused_instants(
    make: Factory, clock: FakeClock
) -> None:

    def define(jobs: SingletonJobs) -> None:
        @jobs.interval("beat", every=1.0)
        async def beat() -> None:
            pass

    b = await failover(make, clock, define, 2.5, paused="beat")
    await b.resume("beat")
    await clock.advance(2.5)
    entries = await oldest_first(b, "beat")
    b_paused = [e for e in entries if e.node_id == "b" and e.reason == DropReason.PAUSED.value]
    gap_entries = [e for e in entries if e.reason == NO_LEADER]
    assert b_paused and gap_entries, entries
    assert max(e.scheduled_at for e in gap_entries) < min(e.scheduled_at for e in b_paused)


async def test_a_stall_is_one_late_entry_that_counts_its_instants(
    make: Factory, clock: FakeClock
) -> None:
    """The ticks a stalled leader skips are one "late" entry with their count and last
    instant: the history then accounts for them, and no later leader finds them a gap."""
    jobs = make(lock_expiry=100.0)

    @jobs.fixed_rate("tick", every=0.1)
    async def tick() -> None:
        pass

    await jobs.start()
    await clock.advance(1.0)
    clock.stall(5.0)
    await clock.advance(0.0)
    await clock.advance(0.25)
    [late] = [e for e in await jobs.history("tick") if e.reason == DropReason.LATE.value]
    assert late.count is not None and late.count >= 49 and late.last_at is not None
    assert late.last_at - late.scheduled_at == timedelta(seconds=0.1) * (late.count - 1)


def test_a_mark_no_script_writes_reads_as_none_and_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert cursor_of("12:7:", 8, "job") == 12 and cursor_of("12:7:", 7, "job") is None
    assert cursor_of("12:7:5", 7, "job") == 5
    with caplog.at_level("WARNING"):
        assert cursor_of("twelve", 8, "job") is None
        assert cursor_of("1:2:x", 8, "job") is None
    assert "history mark of job 'job'" in caplog.text
    assert next_mark("twelve", "8", 20) == "20:8:"
    assert next_mark("12:7:5", "7", 20) == "20:7:5"
    assert next_mark("12:7:5", "8", 10) == "12:8:12"


def test_the_status_route_shows_a_counted_entry() -> None:
    entry = Occurrence(at(1), True, "b", 7, at(9), reason=NO_LEADER, count=8, last_at=at(8))
    shown = HistoryEntry.of(entry)
    assert (shown.kind, shown.count, shown.last_at) == ("missed", 8, at(8))
    assert shown.reason_text is not None and "no node led the job" in shown.reason_text
    assert HistoryEntry.of(replace(entry, count=None)).count is None
