"""A job's checkpoint as its runner on this node keeps it: read from the store once per term,
replaced by the result of each fenced write. The record itself, its encoding and the store
calls are in ``_checkpoint.py``.

Only the leader writes, fenced by its term's token inside the store, so within a term the
copy kept here is the stored record, but for an operator's ``reset_checkpoint``, which
deletes the record unfenced: the leader hears of it in its next election round (brought
forward by the reset's notice) and ``forget``s this copy, so the next run reads the store. A
read or write in flight across the reset is not trusted either (``_generation``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from datetime import datetime

from .._checkpoint import Checkpoint, FinishedRun, JSONValue, StateSave, encode_state
from .._errors import LeadershipLost, UsageError
from .._outcomes import Outcome
from .._store.base import Store

__all__ = ["Progress"]

logger = logging.getLogger("fastapi_singletonjob.checkpoint")

_SKEW_WARNING_S = 5.0
"""How far this node's end of a run may lie from the store's stamp before it says so: far
more than a slow write takes (the stamp follows the end by the write's time)."""


class Progress:
    """One job's checkpoint on this node."""

    __slots__ = (
        "_cached",
        "_generation",
        "_job",
        "_max_bytes",
        "_node_id",
        "_retention_s",
        "_skew_warned",
        "_state",
        "_state_known",
        "_store",
        "_term",
        "read_at",
    )

    def __init__(
        self,
        store: Store,
        job: str,
        node_id: str,
        *,
        retention_s: float,
        max_state_bytes: int,
    ) -> None:
        self._store = store
        self._job = job
        self._node_id = node_id
        self._retention_s = retention_s
        self._max_bytes = max_state_bytes
        self._cached: Checkpoint | None = None
        self._state: JSONValue = None
        """The stored state as this term knows it: read at its start, then as saved."""
        self._state_known = True
        """False after a ``save_state`` whose outcome is unknown (the next run reads again)."""
        self._term: int | None = None
        """The term whose start (or last write) ``_cached`` is from; None: read again."""
        self._skew_warned = False
        self.read_at: datetime | None = None
        """The store's clock when ``load`` last read the record: the clock its
        ``last_completed_at`` is on (a new leader's interval spacing, ``misfire.put_off_s``)."""
        self._generation = 0
        """Raised by each ``forget``: a read or write that began before one tells nothing
        of what is stored now."""

    def loaded_for(self, token: int) -> bool:
        """Whether the checkpoint is known for term ``token`` (no read needed)."""
        return self._term == token

    async def load(self, token: int, timeout_s: float) -> Checkpoint | None:
        """The checkpoint as it stands for term ``token``: read from the store at the first
        run of a term (``ConnectionError`` when the store does not answer in time)."""
        if self._term != token:
            generation = self._generation
            self._cached, self.read_at = await self._store.load_checkpoint(
                self._job, timeout_s=timeout_s
            )
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
        self._term = None
        self._state_known = False

    async def record(
        self,
        token: int,
        outcome: Outcome,
        scheduled_at: datetime,
        completed_at: datetime,
        error: str | None,
        timeout_s: float,
    ) -> bool:
        """Record a finished run, fenced; a refusal or a store error is logged, and the next
        run reads the stored record again. False on a store error (the store did not answer
        in time, or failed), else True. ``completed_at`` (this node's clock) is not
        stored: the store stamps the record with its own clock, and a node whose clock is
        far from it is told so."""
        self._term = None
        generation = self._generation
        written = None
        try:
            if timeout_s > 0:  # else the term is over, and the store would refuse the write
                run = FinishedRun(
                    self._job, token, self._node_id, outcome, scheduled_at, error, self._retention_s
                )
                written = await self._store.record_run(run, timeout_s=timeout_s)
        except Exception as exc:
            logger.warning(
                "job %r: node %s could not record its run of %s in the checkpoint: %r",
                self._job,
                self._node_id,
                scheduled_at.isoformat(),
                exc,
            )
            return False
        if written is None:
            logger.warning(
                "job %r: the run of %s on node %s ended after its term (fencing token %d); "
                "not recorded, the next leader resumes from the stored checkpoint",
                self._job,
                scheduled_at.isoformat(),
                self._node_id,
                token,
            )
            return True
        self._warn_if_skewed(completed_at, written.last_completed_at)
        if generation != self._generation:
            return True  # reset meanwhile: whether before or after this write is unknown
        self._cached = dataclasses.replace(written, state=self._state)
        self._term = token if self._state_known else None
        return True

    def _warn_if_skewed(self, ended_at: datetime, stamped_at: datetime | None) -> None:
        """Say so when this node's wall clock is far from the store's: the record shows the
        store's time (``RECORD_RUN`` stamps it), which comes a moment after ``ended_at`` on a
        clock in sync; the node's own log lines and status show its clock's."""
        if stamped_at is None:
            return
        skew_s = (ended_at - stamped_at).total_seconds()
        skewed = abs(skew_s) > _SKEW_WARNING_S
        warned, self._skew_warned = self._skew_warned, skewed
        if skewed and not warned:  # once per spell, not at every run
            logger.warning(
                "job %r: node %s's wall clock is %.3fs %s the store's (fix its time sync): "
                "its checkpoint shows the store's time, its log lines and status its own",
                self._job,
                self._node_id,
                abs(skew_s),
                "ahead of" if skew_s > 0 else "behind",
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


def no_checkpoint(job: str) -> UsageError:
    """The error of ``save_state`` on a job defined with ``checkpoint=False``."""
    return UsageError(
        f"job {job!r} was defined with checkpoint=False, so it has no state to save; "
        "remove checkpoint=False to keep a checkpoint"
    )
