"""A job's checkpoint as its runner on this node keeps it: read from the store once per term,
then kept up to date by each run's record, which this copy shows at once while the record
goes to the store after the run (``_run.recorder``). The record itself, its encoding and the
store calls are in ``_checkpoint.py``.

Only the leader writes, fenced by its term's token inside the store, so within a term the
copy kept here is the stored record (a moment ahead of it while records are on their way; the
store's own stamp and ``iteration`` replace the guess when it answers), but for an operator's
``reset_checkpoint``, which deletes the record unfenced: the leader hears of it in its next
election round (brought forward by the reset's notice) and ``forget``s this copy, so the next
run reads the store. A read or write in flight across the reset is not trusted either
(``_generation``, ``_stale``). A record the store did not answer in time (or refused) leaves
the copy unknown: the next run reads the store again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .._checkpoint import Checkpoint, FinishedRun, JSONValue, StateSave, encode_state
from .._errors import LeadershipLost, UsageError
from .._frozen import maker
from .._outcomes import OUTCOME_WORDS, Outcome
from .._store.base import Store
from .._store.records import shorten_error
from .recorder import Recorder, Written

__all__ = ["Progress"]

logger = logging.getLogger("fastapi_singletonjob.checkpoint")

_checkpoint = maker(Checkpoint)
"""``Checkpoint``, made once per run: its fields in order, positionally."""
_new = tuple.__new__
"""``FinishedRun`` from all its fields in order: ``_new(FinishedRun, fields)``, its
``_make`` without the Python call around it (no keyword parsing: one per run)."""

_Fresh = list[Any]
"""A record's change to the checkpoint: ``iteration``, ``last_completed_at``,
``last_scheduled_at``, ``last_outcome``, ``last_error``, ``fencing_token`` (a list: the
store's answer puts its ``iteration`` and clock in place)."""


class Progress:
    """One job's checkpoint on this node."""

    __slots__ = (
        "_cached",
        "_fresh",
        "_generation",
        "_held",
        "_history",
        "_job",
        "_max_bytes",
        "_node_id",
        "_on_answer",
        "_recorder",
        "_retention_s",
        "_stale",
        "_state",
        "_state_known",
        "_store",
        "_term",
        "_told",
        "_unwritten",
        "mark",
        "read_at",
    )

    def __init__(
        self,
        store: Store,
        job: str,
        node_id: str,
        *,
        recorder: Recorder,
        retention_s: float,
        history: int = 0,
        max_state_bytes: int,
    ) -> None:
        self._store = store
        self._recorder = recorder
        self._history = history
        """How many occurrences the job's history keeps (0: none)."""
        self._job = job
        self._node_id = node_id
        self._retention_s = retention_s
        self._max_bytes = max_state_bytes
        self._cached: Checkpoint | None = None
        self._fresh: _Fresh | None = None
        """What the term's last record changed, not yet made into ``_cached`` (``cached``
        makes it, once per run rather than once per record and once per answer)."""
        self._state: JSONValue = None
        """The stored state as this term knows it: read at its start, then as saved."""
        self._state_known = True
        """False after a ``save_state`` whose outcome is unknown (the next run reads again)."""
        self._term: int | None = None
        """The term whose start (or last write) ``_cached`` is from; None: read again."""
        self.read_at: datetime | None = None
        """The store's clock when ``load`` last read the record: the clock its
        ``last_completed_at`` is on (a new leader's interval spacing, ``misfire.put_off_s``)."""
        self._generation = 0
        """Raised by each ``forget``: a read or write that began before one tells nothing
        of what is stored now."""
        self._unwritten = 0
        """Records put (``record``) whose write the store has not answered yet."""
        self._stale = 0
        """Of those, the first ones, put before the last ``forget``: their answers (which come
        in the order the records were put) tell nothing of what is stored now."""
        self._told: Callable[[int, float, bool], None] = _unwatched
        self._on_answer: Written = self._answered
        """Bound once: a record's callback costs no object of its own."""
        self.mark: str | None = None
        """Where the history stood when ``load`` last read the record (``_history``)."""
        self._held: tuple[int, list[FinishedRun]] | None = None
        """A term's entries for the instants before it that no node ran (``hold``), put with
        its next record so that they cost no call of their own."""

    @property
    def history(self) -> int:
        """How many occurrences the job's history keeps (0: none)."""
        return self._history

    def loaded_for(self, token: int) -> bool:
        """Whether the checkpoint is known for term ``token`` (no read needed)."""
        return self._term == token

    @property
    def iteration(self) -> int:
        """The stored ``iteration`` as this node knows it (0 for none), without making the
        ``Checkpoint`` (``cached``)."""
        fresh, cached = self._fresh, self._cached
        return fresh[0] if fresh is not None else cached.iteration if cached else 0

    @property
    def cached(self) -> Checkpoint | None:
        """The checkpoint as this node knows it (current when ``loaded_for`` the term)."""
        fresh = self._fresh
        if fresh is not None:
            self._fresh = None
            iteration, completed_at, scheduled_at, outcome, error, token = fresh
            self._cached = _checkpoint(
                iteration,
                completed_at,
                scheduled_at,
                outcome,
                error,
                self._node_id,
                token,
                self._state,
            )
        return self._cached

    async def load(self, token: int, timeout_s: float) -> Checkpoint | None:
        """The checkpoint as it stands for term ``token``: read from the store at the first
        run of a term (``ConnectionError`` when the store does not answer in time)."""
        if self._term != token:
            generation = self._generation
            self._cached, self.read_at, self.mark = await self._store.load_checkpoint(
                self._job, timeout_s=timeout_s
            )
            self._fresh = None
            self._state = None if self._cached is None else self._cached.state
            # Reset while the read was on its way: this run uses what it read, the next reads
            # again.
            self._state_known = generation == self._generation
            self._term = token if self._state_known else None
        return self._cached

    def forget(self) -> None:
        """The record was reset (an operator's ``reset_checkpoint``): read it again at the
        next run, and trust no read or write in flight now."""
        self._generation += 1
        self._stale = self._unwritten
        self._term = None
        self._state_known = False
        self._held = None  # no instant before a reset is found missed

    def watch(self, written: Callable[[int, float, bool], None]) -> None:
        """Tell ``written`` of each record's answer (``record``): the term's token, the
        monotonic time the record was put, and whether the store answered (False: it did
        not in time, or failed; then the next run reads the stored record again)."""
        self._told = written

    def record(
        self,
        token: int,
        outcome: Outcome,
        scheduled_at: datetime,
        completed_at: datetime,
        error: str | None,
        timeout_s: float,
        started_at: datetime | None = None,
        duration_s: float = 0.0,
    ) -> None:
        """Record a finished run, fenced, off the run path: the record goes to the store with
        the others of this turn (``Recorder``), and the copy kept here already shows it, so
        that the term's next run starts at once with the right ``iteration``. The runner
        ``watch``ing is told how the write went. A refusal (the term is over) or a store error
        is logged. ``completed_at`` (this node's clock) stands in for the store's stamp until
        the store answers with it, and is never stored."""
        if timeout_s <= 0:  # the term is over: the store would refuse the write
            self._refused(token, scheduled_at)
            self._told(token, 0.0, True)
            return
        success = outcome is Outcome.SUCCESS
        if self._term == token and self._state_known:
            fresh = self._fresh
            if fresh is None:
                cached = self._cached
                before = cached.iteration if cached is not None else 0
                self._fresh = [
                    before + success,
                    completed_at,
                    scheduled_at,
                    OUTCOME_WORDS[outcome],
                    None if success else shorten_error(error) or None,
                    token,
                ]
            else:  # changed in place: no list per run that outlives a young collection
                fresh[0] += success
                fresh[1], fresh[2], fresh[3] = completed_at, scheduled_at, OUTCOME_WORDS[outcome]
                fresh[4] = None if success else shorten_error(error) or None
                fresh[5] = token
        else:  # not known for this term (a reset, a state save that failed): read it again
            self._term = None
        self._unwritten += 1
        run = _new(
            FinishedRun,
            (
                self._job,
                token,
                self._node_id,
                outcome,
                scheduled_at,
                error,
                self._retention_s,
                started_at,
                duration_s,
                self._history,
                None,
                1,
                None,
            ),
        )
        if self._held is not None:
            self._put_held(token, timeout_s)
        self._recorder.put(run, timeout_s, self._on_answer)

    def missed(
        self,
        token: int,
        scheduled_at: datetime,
        reason: str,
        timeout_s: float,
        *,
        count: int = 1,
        last_at: datetime | None = None,
    ) -> None:
        """Add to the job's history, fenced and off the run path, that term ``token`` did not
        run ``scheduled_at`` (and ``count`` instants from it, up to ``last_at``: 0 for more
        than were counted), and why (a ``DropReason`` value); nothing without a history."""
        if self._history <= 0 or timeout_s <= 0:
            return
        self._put_held(token, timeout_s)
        self._recorder.put(
            self._missed(token, scheduled_at, reason, count, last_at), timeout_s, _ignored
        )

    def hold(
        self, token: int, entries: list[tuple[datetime, int, datetime | None]], reason: str
    ) -> None:
        """Keep term ``token``'s entries for the instants before it that no node ran, each
        ``(first, count, last)``, until the term's next record (run or missed instant) goes:
        they go in its call, before it. A term that records nothing records none of them
        either; the history's mark has not moved, so its successor finds them again."""
        if self._history > 0 and entries:
            held = [
                self._missed(token, first, reason, count, last) for first, count, last in entries
            ]
            self._held = (token, held)

    def _put_held(self, token: int, timeout_s: float) -> None:
        held, self._held = self._held, None
        if held is not None and held[0] == token:
            for run in held[1]:
                self._recorder.put(run, timeout_s, _ignored)

    def _missed(
        self, token: int, scheduled_at: datetime, reason: str, count: int, last_at: datetime | None
    ) -> FinishedRun:
        return FinishedRun(
            self._job,
            token,
            self._node_id,
            Outcome.CANCELLED,  # not read: a missed instant has no outcome
            scheduled_at,
            None,
            self._retention_s,
            history=self._history,
            missed=reason,
            instants=count,
            last_at=last_at,
        )

    def _answered(
        self,
        run: FinishedRun,
        put_at: float,
        iteration: int | None | Exception,
        at: datetime | None,
    ) -> None:
        """The store's answer to a record of ``record`` (``Recorder``'s ``Written``)."""
        self._unwritten -= 1
        stale = self._stale > 0  # put before a reset (``forget``): it tells nothing now
        if stale:
            self._stale -= 1
        token = run.token
        if isinstance(iteration, Exception):
            logger.warning(
                "job %r: node %s could not record a run in the checkpoint: %r",
                self._job,
                self._node_id,
                iteration,
            )
            self._term = None
            self._told(token, put_at, False)
            return
        if iteration is None:
            self._refused(token, run.scheduled_at)
        elif (
            at is not None
            and not self._unwritten  # else a later record's guess is the newer
            and not stale
            and self._term == token
        ):
            fresh = self._fresh
            if fresh is not None:
                fresh[0], fresh[1] = iteration, at
            elif self._cached is not None:
                cached = self._cached
                self._cached = _checkpoint(
                    iteration,
                    at,
                    cached.last_scheduled_at,
                    cached.last_outcome,
                    cached.last_error,
                    cached.node_id,
                    cached.fencing_token,
                    cached.state,
                )
        self._told(token, put_at, True)

    def _refused(self, token: int, scheduled_at: datetime) -> None:
        """The record of a run of term ``token`` was not written: the term is over."""
        self._term = None
        logger.warning(
            "job %r: the run of %s on node %s ended after its term (fencing token %d); "
            "not recorded, the next leader resumes from the stored checkpoint",
            self._job,
            scheduled_at.isoformat(),
            self._node_id,
            token,
        )

    async def save_state(self, token: int, value: object, timeout_s: float) -> None:
        """Fenced write of the job's state (see ``JobContext.save_state``)."""
        state_json = encode_state(self._job, value, self._max_bytes)
        if timeout_s <= 0:
            raise self._lost(token)
        self._state_known = False  # until it is known whether the state was saved
        generation = self._generation
        save = StateSave(self._job, token, self._node_id, state_json, self._retention_s)
        saved = await self._store.save_state(save, timeout_s=timeout_s)
        if not saved:
            raise self._lost(token)
        if generation == self._generation:  # else reset meanwhile: the next run reads again
            self._state, self._state_known = json.loads(state_json), True

    def _lost(self, token: int) -> LeadershipLost:
        return LeadershipLost(
            f"the state was not saved: node {self._node_id}'s term (fencing token {token}) "
            "has ended; stop this run, the next leader resumes from the stored state",
            job=self._job,
        )


def _ignored(
    run: FinishedRun, put_at: float, outcome: int | None | Exception, at: datetime | None
) -> None:
    """A history entry's answer: a missed instant's entry that is lost is only that."""


def _unwatched(token: int, put_at: float, answered: bool) -> None:
    """No runner watches (a ``Progress`` of its own, in a test)."""


def no_checkpoint(job: str) -> UsageError:
    """The error of ``save_state`` on a job defined with ``checkpoint=False``."""
    return UsageError(
        f"job {job!r} was defined with checkpoint=False, so it has no state to save; "
        "remove checkpoint=False to keep a checkpoint"
    )
