"""The in-process store of ``memory://`` URLs: the whole ``Store`` interface in Python, on
the injected clock, for one process (tests, a single replica).

It does in Python what the Redis scripts do (``_store.redis.scripts``): ``ELECT`` with the
membership, the placement and the controls, ``RELEASE``, ``CLAIM``, the fenced ``RECORD_RUN``
and ``SAVE_STATE``, ``CONTROL``, ``RESET_CHECKPOINT``, and the cluster read; locks and records
expire on the clock's ``monotonic()``, and its ``now()`` is the store's clock.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from .._checkpoint import (
    DEFAULT_CHECKPOINT_TIMEOUT_S,
    ITERATION_DIGITS,
    Checkpoint,
    FinishedRun,
    Recorded,
    StateSave,
    checked,
    digits,
    to_unix_us,
)
from .._clock import Clock
from .._history import Occurrence, history_entry, next_mark, parse_entries
from .._lock_value import is_lock_value, lock_value, parse_lock_value
from .._outcomes import Outcome
from .._overdue import Anchor, parse_anchor, parse_spell, spell_value
from . import keys as _keys
from .base import (
    DEFAULT_CLAIM_TIMEOUT_S,
    DEFAULT_CONTROL_TIMEOUT_S,
    DEFAULT_KEEPALIVE_S,
    DEFAULT_MAX_AHEAD_US,
    ClaimResult,
    ClusterData,
    JobData,
    LeaseReply,
    LeaseRequest,
    OverdueCheck,
    OverdueReply,
    OverdueState,
    ReleaseListener,
)
from .membership import MemberRecord, Membership
from .records import job_names, retention_ms, run_arg, shorten_error, token_text

__all__ = ["MemoryLeaseStore"]


@dataclass
class _MemoryData:
    """What one ``memory://`` store holds; the keys are scoped by project
    (``MemoryLeaseStore._key``)."""

    locks: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Per job key: the lock's value and its expiry."""
    fences: dict[str, int] = field(default_factory=dict)
    """Per job key: the last fencing token granted."""
    claimed: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per job key: the last instant claimed (µs) and the token of the term that claimed it."""
    listeners: set[ReleaseListener] = field(default_factory=set)
    checkpoints: dict[str, tuple[dict[str, str], float]] = field(default_factory=dict)
    """Per job key: the checkpoint's fields (as the Redis hash holds them) and its expiry."""
    histories: dict[str, tuple[list[str], float]] = field(default_factory=dict)
    """Per job key: the history's entries, newest first (as the Redis list holds them), and
    its expiry."""
    members: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Per project and owner id: the membership record (JSON) and its expiry."""
    controls: dict[str, str] = field(default_factory=dict)
    """Per project and field of the controls hash (``_store.keys.control_field``): its value."""
    joined: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Per project and owner id: when it joined (ms) and its jobs digest (placement)."""
    epochs: dict[str, int] = field(default_factory=dict)
    """Per project: the placement epoch, raised at each join and leave."""
    spells: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Per job key: its open overdue spell (``<since µs>:<anchor>``) and its expiry."""


class _Registry:
    """The data of every ``memory://`` store of this process, one set per (clock, URL):
    instances that share both see each other. Held weakly by clock, so a test's clock and
    its data go together."""

    def __init__(self) -> None:
        self._by_clock: weakref.WeakKeyDictionary[Clock, dict[str, _MemoryData]] = (
            weakref.WeakKeyDictionary()
        )

    def data(self, clock: Clock, url: str) -> _MemoryData:
        """The data that stores on ``clock`` and ``url`` share (new on first use)."""
        return self._by_clock.setdefault(clock, {}).setdefault(url, _MemoryData())


_REGISTRY = _Registry()


class MemoryLeaseStore:
    """In-process lease store for ``memory://`` URLs: one process only, no persistence.

    Locks expire on the injected clock. Instances created with the same clock and URL share
    their locks, so several ``SingletonJobs`` in one test process elect one leader.
    """

    def __init__(self, project: str, clock: Clock, url: str = "memory://") -> None:
        self._project = project
        self._clock = clock
        self._data = _REGISTRY.data(clock, url)
        self.membership: Membership | None = None

    def _key(self, name: str) -> str:
        """``name`` (a job, a field of the controls hash, an owner id) in this project."""
        return f"{self._project}\x00{name}"

    # Leases

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        """See ``Store.elect``."""
        now = self._clock.monotonic()
        self._keep_member(node_id)
        replies = []
        for request in requests:
            key = self._key(request.job)
            current = self._data.locks.get(key)
            if current is not None and current[1] <= now:
                current = None
            held = False
            if current is None and not request.take:
                replies.append(LeaseReply(request.job, False, None, None))
                continue
            if current is None:
                token = self._data.fences.get(key, 0) + 1
                self._data.fences[key] = token
                current = (lock_value(token, node_id), now + request.ttl_s)
                self._data.locks[key] = current
                held = True
            elif is_lock_value(request.held) and current[0] == request.held:
                current = (current[0], now + request.ttl_s)
                self._data.locks[key] = current
                held = True
            record = self._data.checkpoints.get(key)
            if held and request.retention_s is not None and record and record[1] > now:
                self._data.checkpoints[key] = (record[0], now + request.retention_s)
            paused, triggered, step_down, reset = self._flags(request.job, held)
            replies.append(
                LeaseReply(
                    request.job,
                    held,
                    current[0],
                    max(current[1] - now, 0.0),
                    paused=paused,
                    triggered=triggered,
                    step_down=step_down,
                    checkpoint_reset=reset,
                )
            )
        await asyncio.sleep(0)  # a real store is a suspension point too
        return replies

    async def release(
        self, node_id: str, values: dict[str, str], last_us: Mapping[str, int] | None = None
    ) -> int:
        """See ``Store.release``."""
        released = 0
        now_us = to_unix_us(self._clock.now())
        for job, value in values.items():
            key = self._key(job)
            current = self._data.locks.get(key)
            if current is not None and is_lock_value(value) and current[0] == value:
                del self._data.locks[key]
                released += 1
                instant = (last_us or {}).get(job)
                if instant is not None and instant <= now_us + DEFAULT_MAX_AHEAD_US:
                    token = parse_lock_value(value)[0] or 0
                    if instant > self._data.claimed.get(key, (-1, 0))[0]:
                        self._data.claimed[key] = (instant, token)
        if released:
            names = frozenset(job for job in values if self._key(job) not in self._data.locks)
            for listener in list(self._data.listeners):
                listener(names)
        return released

    async def claim(
        self,
        job: str,
        value: str,
        instant_us: int,
        *,
        max_ahead_us: int = DEFAULT_MAX_AHEAD_US,
        timeout_s: float = DEFAULT_CLAIM_TIMEOUT_S,
    ) -> ClaimResult:
        """See ``Store.claim``; the injected clock's ``now()`` is the store's clock (it
        answers at once: ``timeout_s`` is never reached)."""
        key = self._key(job)
        current = self._data.locks.get(key)
        await asyncio.sleep(0)
        if (
            current is None
            or not is_lock_value(value)
            or current[0] != value
            or current[1] <= self._clock.monotonic()
        ):
            return ClaimResult.NOT_HOLDER
        last, by = self._data.claimed.get(key, (-1, 0))
        token = parse_lock_value(value)[0]
        if instant_us == last and by == token:
            return ClaimResult.CLAIMED  # this very term's claim, retried after its reply was lost
        if instant_us <= last:
            return ClaimResult.ALREADY_RUN
        if instant_us > to_unix_us(self._clock.now()) + max_ahead_us:
            return ClaimResult.CLOCK_AHEAD
        self._data.claimed[key] = (instant_us, token or 0)
        return ClaimResult.CLAIMED

    async def listen_releases(
        self, on_release: ReleaseListener, *, keepalive_s: float = DEFAULT_KEEPALIVE_S
    ) -> None:
        """See ``Store.listen_releases``; in one process there is no connection to
        check, so ``keepalive_s`` is not used."""
        self._data.listeners.add(on_release)
        try:
            await asyncio.Event().wait()
        finally:
            self._data.listeners.discard(on_release)

    async def ping(self) -> None:
        """See ``Store.ping``."""

    async def aclose(self) -> None:
        """See ``Store.aclose``."""

    # Membership and controls, as ELECT keeps and reads them

    def announce(self, membership: Membership) -> None:
        """See ``Store.announce``."""
        self.membership = membership

    def _keep_member(self, owner: str) -> None:
        """The membership part of one ``elect`` call, placement included."""
        member = self.membership
        if member is None or member.left:
            return
        now = self._clock.monotonic()
        now_ms = round(self._clock.now().timestamp() * 1000)
        members, joined = self._data.members, self._data.joined
        epochs = self._data.epochs
        key = self._key(owner)
        for other, (_, expiry) in list(members.items()):
            if expiry <= now:
                del members[other]
                joined.pop(other, None)
                epochs[self._project] = epochs.get(self._project, 0) + 1
        if member.payload() or key not in members:
            members[key] = (member.record.to_json(), now + member.ttl_ms / 1000)
            if key in joined and joined[key][1] != member.digest:  # the record changed
                joined[key] = (joined[key][0], member.digest)
                epochs[self._project] = epochs.get(self._project, 0) + 1
        else:
            members[key] = (members[key][0], now + member.ttl_ms / 1000)
        if key not in joined:
            joined[key] = (now_ms, member.digest)
            epochs[self._project] = epochs.get(self._project, 0) + 1
        member.confirmed(True)
        epoch = str(epochs.get(self._project, 0))
        prefix = self._key("")
        flat = [
            item
            for other, (at, digest) in joined.items()
            if other.startswith(prefix)
            for item in (other[len(prefix) :], f"{at}|{digest}")
        ]
        member.placed(now_ms, epoch, flat if epoch != member.epoch else [])

    def _flags(self, job: str, held: bool) -> tuple[bool, bool, bool, bool]:
        """The job's controls for one ``elect`` reply: paused, triggered, step-down, reset;
        the requests are consumed by the holder only."""
        controls = self._data.controls
        paused = self._key(_keys.control_field("paused", job)) in controls
        if not held:
            return paused, False, False, False

        def take(control: _keys.Control) -> bool:
            key = self._key(_keys.control_field(control, job))
            return controls.pop(key, None) is not None

        return paused, take("trigger"), take("step-down"), take("reset")

    async def set_control(
        self, field: str, value: str | None, *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> bool:
        """See ``Store.set_control``."""
        await asyncio.sleep(0)
        key = self._key(field)
        if value is None:
            changed = self._data.controls.pop(key, None) is not None
        else:
            changed = key not in self._data.controls
            self._data.controls[key] = value
        self._notify_control(field)
        return changed

    def _notify_control(self, field: str) -> None:
        """Wake every node's election about the job of ``field``, as the scripts' "control
        <job>" notice does."""
        job = frozenset({field.partition(":")[2]})
        for listener in list(self._data.listeners):
            listener(job)

    async def leave(self) -> None:
        """See ``Store.leave``."""
        await asyncio.sleep(0)
        if self.membership is not None:
            self.membership.left = True
            key = self._key(self.membership.record.owner)
            self._data.members.pop(key, None)
            if self._data.joined.pop(key, None) is not None:
                epochs = self._data.epochs
                epochs[self._project] = epochs.get(self._project, 0) + 1
            self.membership.confirmed(False)

    async def read_cluster(
        self, jobs: Iterable[str] = (), *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> ClusterData:
        """See ``Store.read_cluster``."""
        await asyncio.sleep(0)
        mono, now = self._clock.monotonic(), self._clock.now()
        prefix = self._key("")
        members = []
        for key, (text, expiry) in self._data.members.items():
            owner = key.removeprefix(prefix)
            record = MemberRecord.from_json(owner, text) if key.startswith(prefix) else None
            if record is not None and expiry > mono:
                members.append((record, now + timedelta(seconds=expiry - mono)))
        controls = {
            key.removeprefix(prefix): value
            for key, value in self._data.controls.items()
            if key.startswith(prefix)
        }
        data = {}
        for name in sorted(job_names(members, controls).union(jobs)):
            lock = self._data.locks.get(self._key(name))
            live = lock is not None and lock[1] > mono
            claimed = self._data.claimed.get(self._key(name))
            fields, expiry = self._data.checkpoints.get(self._key(name), (None, 0.0))
            data[name] = JobData(
                name=name,
                value=lock[0] if lock is not None and live else None,
                ttl_s=lock[1] - mono if lock is not None and live else None,
                last_us=claimed[0] if claimed else None,
                checkpoint=checked(name, fields if fields and expiry > mono else None),
                overdue_since=None if (spell := self._spell(name)) is None else spell[0],
            )
        return ClusterData(now=now, members=members, controls=controls, jobs=data)

    async def read_members(
        self, owners: Sequence[str], *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> dict[str, MemberRecord]:
        """See ``Store.read_members``."""
        await asyncio.sleep(0)
        mono, found = self._clock.monotonic(), {}
        for owner in owners:
            text, expiry = self._data.members.get(self._key(owner), ("", 0.0))
            record = MemberRecord.from_json(owner, text) if expiry > mono else None
            if record is not None:
                found[owner] = record
        return found

    # Checkpoints, as RECORD_RUN and SAVE_STATE write them

    async def record_runs(
        self, runs: Sequence[FinishedRun], *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Recorded:
        """See ``Store.record_runs``; ``timeout_s`` is not used (no I/O). The runs' end is
        stamped with the store's clock, the injected clock's ``now()``, as ``RECORD_RUN``
        stamps it with the server's ``TIME``."""
        await asyncio.sleep(0)  # a real store is a suspension point too
        now = self._clock.now()
        return Recorded(now, [self._record_run(run, to_unix_us(now)) for run in runs])

    def _record_run(self, run: FinishedRun, now_us: int) -> int | None:
        """``RECORD_RUN`` for one run: its job's iteration after the write (0 for a missed
        instant), None if fenced; and its history entry."""
        run_arg(run)  # the checks of the Redis store's encoding
        record = self._fenced(run.job, run.token)
        if record is None:
            return None
        error = shorten_error(run.error)
        retention = retention_ms(run.retention_s)
        iteration = 0
        if run.missed is None:
            success = run.outcome is Outcome.SUCCESS
            iteration = int(record["iteration"]) + success
            record.update(
                iteration=str(iteration),
                last_outcome=run.outcome.value,
                last_scheduled_us=str(to_unix_us(run.scheduled_at)),
                last_completed_us=str(now_us),
                node_id=run.node_id,
                fencing_token=token_text(run.token),
            )
            if success or not error:
                record.pop("last_error", None)
            else:
                record["last_error"] = error
            self._keep(run.job, record, retention)
        if run.history > 0:
            scheduled_us = to_unix_us(run.scheduled_at)
            last_us = 0 if run.last_at is None else to_unix_us(run.last_at)
            entry = history_entry(
                missed=run.missed is not None,
                scheduled_us=to_unix_us(run.scheduled_at),
                started_us=0 if run.started_at is None else to_unix_us(run.started_at),
                duration_us=max(0, round(run.duration_s * 1e6)),
                recorded_us=now_us,
                node_id=run.node_id,
                token=token_text(run.token),
                outcome=run.outcome.value if run.missed is None else run.missed,
                error=error,
                count=run.instants,
                last_us=last_us,
            )
            latest = last_us if run.instants != 1 and last_us > scheduled_us else scheduled_us
            key = self._key(run.job)
            if run.missed is None:
                record["history"] = next_mark(record.get("history"), token_text(run.token), latest)
            elif (stored := self._data.checkpoints.get(key)) is not None:
                # Only in a record that exists, keeping its expiry, as the script does.
                fields = self._record(run.job)
                if fields is not None and self._fenced(run.job, run.token) == fields:
                    fields["history"] = next_mark(
                        fields.get("history"), token_text(run.token), latest
                    )
                    self._data.checkpoints[key] = (fields, stored[1])
                elif fields is not None:  # no record: the script deletes it
                    self._data.checkpoints.pop(key, None)
            entries, _ = self._data.histories.get(key, ([], 0.0))
            entries = [entry, *entries][: run.history]
            self._data.histories[key] = (entries, self._clock.monotonic() + int(retention) / 1000)
        return iteration

    async def check_overdue(
        self,
        checks: Sequence[OverdueCheck],
        *,
        retention_s: float,
        timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S,
    ) -> OverdueReply:
        """See ``Store.check_overdue``: as ``OVERDUE`` does it."""
        await asyncio.sleep(0)
        mono, now = self._clock.monotonic(), self._clock.now()
        return OverdueReply(now, [self._check_overdue(c, mono, now, retention_s) for c in checks])

    def _check_overdue(
        self, check: OverdueCheck, mono: float, now: datetime, retention_s: float
    ) -> OverdueState:
        key = self._key(check.job)
        anchor = self._anchor(check.job)
        paused = self._key(_keys.control_field("paused", check.job)) in self._data.controls
        stored = self._data.spells.get(key)
        spell = None if stored is None or stored[1] <= mono else parse_spell(stored[0])
        if spell is not None and (paused or spell[2] != anchor.text):
            spell = None
        if spell is None:
            self._data.spells.pop(key, None)
        opened = tell = False
        if spell is not None and stored is not None and not spell[1] and check.can_tell:
            tell = True
            self._data.spells[key] = (spell_value(spell[0], True, anchor), stored[1])
        elif (
            spell is None
            and not paused
            and check.deadline is not None
            and check.anchor == anchor.text
            and now >= check.deadline
        ):
            opened, tell = True, check.can_tell
            expiry = mono + int(retention_ms(retention_s)) / 1000
            self._data.spells[key] = (spell_value(check.deadline, tell, anchor), expiry)
        current = self._data.spells.get(key)
        return OverdueState(
            anchor, paused, parse_spell(current[0]) if current else None, opened, tell
        )

    def _anchor(self, job: str) -> Anchor:
        """``job``'s anchor, as ``OVERDUE`` builds it from the stored values."""
        record = self._record(job) or {}
        claimed = self._data.claimed.get(self._key(job))
        parts = [
            record.get("last_scheduled_us", ""),
            record.get("last_completed_us", ""),
            "" if claimed is None else str(claimed[0]),
        ]
        return parse_anchor(",".join(part if part.isdigit() else "" for part in parts))

    def _spell(self, job: str) -> tuple[datetime, bool, str] | None:
        """``job``'s open spell, if its anchor is still the job's (as the cluster read has it)."""
        stored = self._data.spells.get(self._key(job))
        if stored is None or stored[1] <= self._clock.monotonic():
            return None
        spell = parse_spell(stored[0])
        return spell if spell is not None and spell[2] == self._anchor(job).text else None

    async def read_history(
        self, job: str, *, limit: int, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> list[Occurrence]:
        """See ``Store.read_history``; ``timeout_s`` is not used (no I/O)."""
        await asyncio.sleep(0)
        entries, expiry = self._data.histories.get(self._key(job), ([], 0.0))
        if expiry <= self._clock.monotonic():
            return []
        return parse_entries(job, entries[:limit])

    async def save_state(
        self, save: StateSave, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """See ``Store.save_state``; ``timeout_s`` is not used (no I/O)."""
        token, retention = token_text(save.token), retention_ms(save.retention_s)
        await asyncio.sleep(0)
        record = self._fenced(save.job, save.token)
        if record is None:
            return False
        record.update(state=save.state_json, node_id=save.node_id, fencing_token=token)
        self._keep(save.job, record, retention)
        return True

    async def read_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Checkpoint | None:
        """See ``Store.read_checkpoint``."""
        await asyncio.sleep(0)
        return checked(job, self._record(job))

    async def load_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> tuple[Checkpoint | None, datetime, str | None]:
        """See ``Store.load_checkpoint``: the store's clock is the injected clock's ``now()``."""
        await asyncio.sleep(0)
        fields = self._record(job)
        record = checked(job, fields)
        mark = fields.get("history") if fields is not None and record is not None else None
        return record, self._clock.now(), mark

    async def reset_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """See ``Store.reset_checkpoint``: as ``RESET_CHECKPOINT``, the control for the
        holder is left while a lock exists."""
        await asyncio.sleep(0)
        found = self._record(job) is not None
        self._data.checkpoints.pop(self._key(job), None)
        lock = self._data.locks.get(self._key(job))
        if lock is not None and lock[1] > self._clock.monotonic():
            field = _keys.control_field("reset", job)
            self._data.controls[self._key(field)] = "1"
            self._notify_control(field)
        return found

    def _record(self, job: str) -> dict[str, str] | None:
        """A copy of ``job``'s record, unless it expired."""
        fields, expiry = self._data.checkpoints.get(self._key(job), (None, 0.0))
        if fields is None or expiry <= self._clock.monotonic():
            self._data.checkpoints.pop(self._key(job), None)
            return None
        return dict(fields)

    def _fenced(self, job: str, token: int) -> dict[str, str] | None:
        """``job``'s record to write on, if term ``token`` holds the lock (else None),
        repaired or started as the scripts do."""
        lock = self._data.locks.get(self._key(job))
        if lock is None or lock[1] <= self._clock.monotonic():
            return None
        if parse_lock_value(lock[0])[0] != token:
            return None
        record = self._record(job)
        try:
            digits(record["iteration"] if record else "0", ITERATION_DIGITS)
        except (KeyError, ValueError):
            record = None
        return record or {"iteration": "0"}

    def _keep(self, job: str, record: dict[str, str], retention: str) -> None:
        """Store ``record`` as ``job``'s, expiring ``retention`` milliseconds from now."""
        expiry = self._clock.monotonic() + int(retention) / 1000
        self._data.checkpoints[self._key(job)] = (record, expiry)

    # What an operator could do to the keys by hand (for tests)

    def delete_lock(self, job: str) -> None:
        """Drop ``job``'s lock as an operator's ``DEL`` would (for tests)."""
        self._data.locks.pop(self._key(job), None)

    def set_lock(self, job: str, value: str, ttl_s: float) -> None:
        """Write ``job``'s lock as an operator's ``SET ... PX`` would (for tests), with any
        value, also one this library would never write."""
        self._data.locks[self._key(job)] = (value, self._clock.monotonic() + ttl_s)

    def set_checkpoint_fields(self, job: str, fields: Mapping[str, str]) -> None:
        """Replace ``job``'s record by ``fields``, without expiry, as an operator's ``DEL``
        and ``HSET`` would (for tests), also with values this library would never write."""
        self._data.checkpoints[self._key(job)] = (dict(fields), math.inf)

    def __repr__(self) -> str:
        return f"MemoryLeaseStore(project={self._project!r})"
