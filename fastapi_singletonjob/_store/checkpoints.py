"""The checkpoint methods of the Redis store: ``RECORD_RUN`` and ``SAVE_STATE`` (their
arguments are encoded in ``_store.records``). The record itself and its encoding are in
``_checkpoint.py``."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ReadOnlyError, ResponseError

from .._checkpoint import (
    DEFAULT_CHECKPOINT_TIMEOUT_S,
    Checkpoint,
    FinishedRun,
    StateSave,
    checked,
    not_a_record,
    written,
)
from . import keys as _keys
from .records import RUN_FIELDS, retention_ms, run_args, token_text
from .redis import scripts as _scripts
from .redis.batch import Batcher

if TYPE_CHECKING:
    from .._errors import StoreReadOnly

__all__ = ["RedisCheckpoints"]


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
        reply = await self._record_batcher.submit((run.job, run_args(run)), timeout_s)
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
        token, retention = token_text(save.token), retention_ms(save.retention_s)
        args = [token, save.node_id, save.state_json, retention]
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
