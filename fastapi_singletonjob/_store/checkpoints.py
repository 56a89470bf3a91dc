"""The checkpoint half of both stores: ``RECORD_RUN`` and ``SAVE_STATE`` run by Redis
(``RedisCheckpoints``) or mimicked in Python on the injected clock (``MemoryCheckpoints``),
and their arguments. The record itself and its encoding are in ``_checkpoint.py``."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ReadOnlyError, ResponseError

from .._checkpoint import (
    DEFAULT_CHECKPOINT_TIMEOUT_S,
    ITERATION_DIGITS,
    MAX_ERROR_CHARS,
    Checkpoint,
    FinishedRun,
    StateSave,
    checked,
    digits,
    not_a_record,
    to_unix_us,
    written,
)
from .._lock_value import MAX_TOKEN, parse_lock_value
from .._outcomes import Outcome
from . import keys as _keys
from .redis import scripts as _scripts
from .redis.batch import Batcher

if TYPE_CHECKING:
    from .._clock import Clock
    from .._errors import StoreReadOnly
    from .memory import _MemoryData

__all__ = ["RUN_FIELDS", "MemoryCheckpoints", "RedisCheckpoints"]

RUN_FIELDS = (
    "iteration",
    "last_scheduled_us",
    "last_completed_us",
    "last_outcome",
    "last_error",
    "node_id",
    "fencing_token",
)
"""The fields ``record_run`` returns, in ``RECORD_RUN``'s order: all but the state, which can
be as large as 64 KiB and which the caller knows (it saved it, or read it)."""


def _shorten_error(error: str | None) -> str:
    """``error`` cut to ``MAX_ERROR_CHARS``, as text Redis takes ("" for none)."""
    if not error:
        return ""
    if len(error) > MAX_ERROR_CHARS:
        error = error[: MAX_ERROR_CHARS - 1] + "\u2026"
    return error.encode(errors="replace").decode()  # a lone surrogate would fail the write


def _token_text(token: int) -> str:
    if isinstance(token, bool) or not isinstance(token, int) or not 0 < token <= MAX_TOKEN:
        raise ValueError(f"token={token!r} is not a fencing token (1 to {MAX_TOKEN})")
    return str(token)


def _retention_ms(retention_s: float) -> str:
    if not (isinstance(retention_s, (int, float)) and 0 < retention_s < math.inf):
        raise ValueError(f"retention_s={retention_s!r} must be a positive number of seconds")
    return str(max(1, round(retention_s * 1000)))


def _run_args(run: FinishedRun) -> list[str]:
    """ARGV of ``RECORD_RUN`` for ``run``, checked; the memory store reads the same list."""
    return [
        _token_text(run.token),
        run.node_id,
        Outcome(run.outcome).value,
        str(to_unix_us(run.scheduled_at)),
        str(to_unix_us(run.completed_at)),
        _shorten_error(run.error),
        _retention_ms(run.retention_s),
    ]


class MemoryCheckpoints:
    """The checkpoint methods of ``MemoryLeaseStore``: ``RECORD_RUN`` and ``SAVE_STATE`` in
    Python, on the store's injected clock (records expire on its ``monotonic()``)."""

    _data: _MemoryData
    _clock: Clock
    _key: Callable[[str], str]

    async def record_run(
        self, run: FinishedRun, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Checkpoint | None:
        """See ``Store.record_run``; ``timeout_s`` is not used (no I/O)."""
        args, job = _run_args(run), run.job
        await asyncio.sleep(0)  # a real store is a suspension point too
        record = self._fenced(job, run.token)
        if record is None:
            return None
        success = args[2] == Outcome.SUCCESS.value
        record["iteration"] = str(int(record["iteration"]) + success)
        record.update(
            last_outcome=args[2],
            last_scheduled_us=args[3],
            last_completed_us=args[4],
            node_id=run.node_id,
            fencing_token=args[0],
        )
        if success or not args[5]:
            record.pop("last_error", None)
        else:
            record["last_error"] = args[5]
        self._keep(job, record, args[6])
        return written(job, {key: value for key, value in record.items() if key in RUN_FIELDS})

    async def save_state(
        self, save: StateSave, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """See ``Store.save_state``; ``timeout_s`` is not used (no I/O)."""
        token_text, retention_ms = _token_text(save.token), _retention_ms(save.retention_s)
        await asyncio.sleep(0)
        record = self._fenced(save.job, save.token)
        if record is None:
            return False
        record.update(state=save.state_json, node_id=save.node_id, fencing_token=token_text)
        self._keep(save.job, record, retention_ms)
        return True

    async def read_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Checkpoint | None:
        """See ``Store.read_checkpoint``."""
        await asyncio.sleep(0)
        return checked(job, self._record(job))

    async def reset_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """See ``Store.reset_checkpoint``."""
        await asyncio.sleep(0)
        found = self._record(job) is not None
        self._data.checkpoints.pop(self._key(job), None)
        return found

    def set_checkpoint_fields(self, job: str, fields: Mapping[str, str]) -> None:
        """Replace ``job``'s record by ``fields``, without expiry, as an operator's ``DEL``
        and ``HSET`` would (for tests), also with values this library would never write."""
        self._data.checkpoints[self._key(job)] = (dict(fields), math.inf)

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

    def _keep(self, job: str, record: dict[str, str], retention_ms: str) -> None:
        expiry = self._clock.monotonic() + int(retention_ms) / 1000
        self._data.checkpoints[self._key(job)] = (record, expiry)


class RedisCheckpoints:
    """The checkpoint methods of ``RedisLeaseStore``: one call each, on the claims' pool
    (never the election's), bounded by ``timeout_s``."""

    _claims: Redis
    _project: str
    _shown: str
    _read_only: Callable[[str], Awaitable[StoreReadOnly]]
    _record_batcher: Batcher[tuple[str, list[str]], Any]  # of _record_runs, built by the store

    @functools.cached_property
    def _checkpoint_scripts(self) -> tuple[AsyncScript, AsyncScript]:
        return (
            self._claims.register_script(_scripts.RECORD_RUN),
            self._claims.register_script(_scripts.SAVE_STATE),
        )

    async def record_run(
        self, run: FinishedRun, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Checkpoint | None:
        """See ``Store.record_run``: one ``EVALSHA`` of ``RECORD_RUN``, with the runs
        of other jobs that ended while this node's previous write was in flight."""
        reply = await self._record_batcher.submit((run.job, _run_args(run)), timeout_s)
        if not isinstance(reply, list):  # -1: the term is over
            return None
        fields = zip(RUN_FIELDS, reply, strict=True)
        return written(run.job, {key: value for key, value in fields if value is not None})

    async def _record_runs(
        self, runs: Sequence[tuple[str, list[str]]], timeout_s: float
    ) -> list[Any]:
        """One ``RECORD_RUN`` call for ``runs`` (job, ARGV): one reply each."""
        jobs = [job for job, _ in runs]
        what = (
            f"record a run of job {jobs[0]!r} (whether it did is unknown)"
            if len(jobs) == 1
            else f"record the runs of {len(jobs)} jobs {jobs[:3]!r}"
            f"{'...' if len(jobs) > 3 else ''} (whether they were is unknown)"
        )
        keys = [key for job in jobs for key in self._checkpoint_keys(job)]
        args = [arg for _, job_args in runs for arg in job_args]
        script = self._checkpoint_scripts[0]
        replies: list[Any] = await self._checkpoint_call(
            what, script(keys=keys, args=args), timeout_s
        )
        return replies

    async def save_state(
        self, save: StateSave, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """See ``Store.save_state``: one ``EVALSHA`` of ``SAVE_STATE``."""
        token, retention_ms = _token_text(save.token), _retention_ms(save.retention_s)
        args = [token, save.node_id, save.state_json, retention_ms]
        script = self._checkpoint_scripts[1]
        reply = await self._checkpoint_call(
            f"save the state of job {save.job!r} (whether it did is unknown)",
            script(keys=self._checkpoint_keys(save.job), args=args),
            timeout_s,
        )
        return int(reply) == 1

    async def read_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Checkpoint | None:
        """See ``Store.read_checkpoint``: one ``HGETALL``."""
        key = _keys.job_key(self._project, job, "checkpoint")
        try:
            raw: dict[bytes, bytes] = await self._checkpoint_call(
                f"read the checkpoint of job {job!r}", self._claims.hgetall(key), timeout_s
            )
        except ResponseError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise
            not_a_record(job, "a key of another type than hash")
            return None
        return checked(job, {key.decode(errors="replace"): value for key, value in raw.items()})

    async def reset_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """See ``Store.reset_checkpoint``: one ``DEL``."""
        key = _keys.job_key(self._project, job, "checkpoint")
        deleted = await self._checkpoint_call(
            f"reset the checkpoint of job {job!r}", self._claims.delete(key), timeout_s
        )
        return int(deleted) > 0

    def _checkpoint_keys(self, job: str) -> list[str]:
        return [_keys.job_key(self._project, job, kind) for kind in ("lock", "checkpoint")]

    async def _checkpoint_call(self, what: str, call: Awaitable[Any], timeout_s: float) -> Any:
        """Await ``call``; ``ConnectionError`` past ``timeout_s``, ``StoreReadOnly`` from a
        replica (see ``RedisLeaseStore._read_only``)."""
        try:
            return await asyncio.wait_for(call, timeout_s)
        except TimeoutError as exc:
            raise ConnectionError(
                f"Redis at {self._shown} did not {what} within {timeout_s:g}s"
            ) from exc
        except ReadOnlyError as exc:
            raise await self._read_only("a read-only replica") from exc
