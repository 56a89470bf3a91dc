"""Checkpoints on Redis: the fenced ``RECORD_RUN`` (many runs in one call: ``_run.recorder``) and
``SAVE_STATE`` scripts with their ``KEYS``, and the operators' read and reset (the
``RESET_CHECKPOINT`` script, which also tells the job's leader). The arguments are encoded in
``_store.records``, the record itself in ``_checkpoint``."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from redis.asyncio import RedisCluster
from redis.exceptions import ReadOnlyError, ResponseError

from ..._checkpoint import (
    DEFAULT_CHECKPOINT_TIMEOUT_S,
    Checkpoint,
    FinishedRun,
    Recorded,
    StateSave,
    checked,
    from_unix_us,
    not_a_record,
)
from ..._clock import Clock
from ..._history import Occurrence, parse_entries
from ..._odd import odd_type
from .. import keys as _keys
from ..records import RunArgs, retention_ms, token_text
from . import scripts as _scripts
from .batch import Batcher
from .connect import bounded
from .topology import Topology, server_time

__all__ = ["RedisCheckpoints"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class RedisCheckpoints:
    """The checkpoint methods of the Redis store: one call each, on the topology's calls
    client (never the election's), bounded by ``timeout_s``."""

    def __init__(self, topology: Topology, project: str, channel: str, *, clock: Clock) -> None:
        self._topology = topology
        self._project = project
        self._channel = channel
        client = topology.calls
        self._record_run = client.register_script(_scripts.RECORD_RUN)
        self._save_state = client.register_script(_scripts.SAVE_STATE)
        # The reset's notice goes by the pub/sub of the releases (sharded on a cluster).
        self._reset = client.register_script(
            _scripts.RESET_CHECKPOINT_SHARDED if topology.sharded else _scripts.RESET_CHECKPOINT
        )
        self._prefix = _keys.job_prefix(project).encode()
        self._run_args = RunArgs()
        self._loads: Batcher[str, tuple[Any, datetime]] = Batcher(
            self._load_all, clock=clock, unanswered=self._unloaded
        )

    async def record_runs(
        self, runs: Sequence[FinishedRun], *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Recorded:
        """See ``Store.record_runs``: one ``EVALSHA`` of ``RECORD_RUN`` for all of ``runs``."""
        jobs = [run.job for run in runs]
        what = (
            f"record a run of job {jobs[0]!r} (whether it did is unknown)"
            if len(jobs) == 1
            else f"record the runs of {len(jobs)} jobs {jobs[:3]!r}"
            f"{'...' if len(jobs) > 3 else ''} (whether they were is unknown)"
        )
        # The project's slot (no runs: one call that writes nothing, which loads the script).
        keys = [_keys.job_key(self._project, jobs[0], "lock") if jobs else self._prefix]
        args = [self._prefix, self._run_args(runs)]
        reply: bytes = await self._call(what, self._record_run(keys=keys, args=args), timeout_s)
        at, *iterations = reply.split(b",")
        return Recorded(
            from_unix_us(int(at)),
            [None if iteration == b"-1" else int(iteration) for iteration in iterations],
        )

    async def save_state(
        self, save: StateSave, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """See ``Store.save_state``: one ``EVALSHA`` of ``SAVE_STATE``."""
        token, retention = token_text(save.token), retention_ms(save.retention_s)
        args = [token, save.node_id, save.state_json, retention]
        reply = await self._call(
            f"save the state of job {save.job!r} (whether it did is unknown)",
            self._save_state(keys=self._keys(save.job), args=args),
            timeout_s,
        )
        return int(reply) == 1

    async def read_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Checkpoint | None:
        """See ``Store.read_checkpoint``: one ``HGETALL``."""
        key = _keys.job_key(self._project, job, "checkpoint")
        try:
            raw: dict[bytes, bytes] = await self._call(
                f"read the checkpoint of job {job!r}", self._topology.calls.hgetall(key), timeout_s
            )
        except ResponseError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise
            not_a_record(job, "a key of another type than hash")
            return None
        return checked(job, {key.decode(errors="replace"): value for key, value in raw.items()})

    async def load_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> tuple[Checkpoint | None, datetime, str | None]:
        """See ``Store.load_checkpoint``: ``HGETALL`` and ``TIME`` in one pipeline, with the
        reads of the other jobs whose terms began meanwhile (``Batcher``: a node that takes
        500 jobs at once reads their records in a round trip or two, not 500, so that no first
        run waits in the pool's queue past its period). On a cluster, which takes no ``TIME``
        in a pipeline, ``TIME`` follows on the master of the project's slot, whose clock
        ``RECORD_RUN`` stamped the records with."""
        raw, now = await self._loads.submit(job, timeout_s)
        if isinstance(raw, ResponseError):
            if not str(raw).startswith("WRONGTYPE"):
                raise raw
            not_a_record(job, "a key of another type than hash")
            return None, now, None
        record = checked(job, {key.decode(errors="replace"): value for key, value in raw.items()})
        mark = raw.get(b"history") if record is not None else None
        return record, now, None if mark is None else mark.decode(errors="replace")

    def _unloaded(self, job: str, timeout_s: float) -> ConnectionError:
        """The error of a read whose deadline passed (see ``Batcher``)."""
        return ConnectionError(
            f"Redis at {self._topology.shown} did not read the checkpoint of job {job!r} "
            f"within {timeout_s:g}s"
        )

    async def _load_all(self, jobs: Sequence[str], timeout_s: float) -> list[tuple[Any, datetime]]:
        """One round trip (two on a cluster) for ``jobs``' records (each, or the
        ``ResponseError`` its read met) and the server's time."""
        what = (
            f"read the checkpoint of job {jobs[0]!r}"
            if len(jobs) == 1
            else f"read the checkpoints of {len(jobs)} jobs {list(jobs[:3])!r}"
            f"{'...' if len(jobs) > 3 else ''}"
        )
        keys = [_keys.job_key(self._project, job, "checkpoint") for job in jobs]
        raws, now = await self._call(what, self._hgetall_and_time(keys), timeout_s)
        return [(raw, now) for raw in raws]

    async def _hgetall_and_time(self, keys: list[str]) -> tuple[list[Any], datetime]:
        """Each of ``keys``' fields (or the ``ResponseError`` its read met) and the server's
        time."""
        client = self._topology.calls
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            if isinstance(client, RedisCluster):
                raws: list[Any] = await pipe.execute(raise_on_error=False)
                time: Any = await server_time(client, keys[0])
            else:
                pipe.time()
                *raws, time = await pipe.execute(raise_on_error=False)
        if isinstance(time, Exception):
            raise time
        seconds, micros = time
        return raws, _EPOCH + timedelta(seconds=int(seconds), microseconds=int(micros))

    async def reset_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """See ``Store.reset_checkpoint``: one ``RESET_CHECKPOINT`` script call, which also
        tells the job's leader."""
        keys = [
            _keys.job_key(self._project, job, "checkpoint"),
            _keys.job_key(self._project, job, "lock"),
            _keys.project_key(self._project, "controls"),
        ]
        args = [self._channel, _keys.control_field("reset", job)]
        deleted = await self._call(
            f"reset the checkpoint of job {job!r}", self._reset(keys=keys, args=args), timeout_s
        )
        return int(deleted) > 0

    async def aclose(self) -> None:
        """Fail the reads not answered yet (``ConnectionError``)."""
        await self._loads.aclose()

    def _keys(self, job: str) -> list[str]:
        """``KEYS`` of the fenced scripts for ``job``: its lock, its checkpoint."""
        return [_keys.job_key(self._project, job, kind) for kind in ("lock", "checkpoint")]

    async def read_history(
        self, job: str, *, limit: int, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> list[Occurrence]:
        """See ``Store.read_history``: one ``LRANGE``."""
        key = _keys.job_key(self._project, job, "history")
        try:
            raw: list[bytes] = await self._call(
                f"read the history of job {job!r}",
                self._topology.calls.lrange(key, 0, max(limit, 1) - 1),
                timeout_s,
            )
        except ResponseError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise
            odd_type(key, "read as no history; the next run's record replaces it")
            return []
        return parse_entries(job, raw)[:limit]

    async def _call(self, what: str, call: Awaitable[Any], timeout_s: float) -> Any:
        """Await ``call``; ``ConnectionError`` past ``timeout_s`` (its connection dropped:
        ``connect.bounded``), ``StoreReadOnly`` from a replica (see ``Topology.read_only``)."""
        try:
            return await bounded(call, timeout_s, self._topology)
        except TimeoutError as exc:
            raise ConnectionError(
                f"Redis at {self._topology.shown} did not {what} within {timeout_s:g}s"
            ) from exc
        except ReadOnlyError as exc:
            raise await self._topology.read_only("a read-only replica") from exc
