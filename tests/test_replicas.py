"""The FastAPI integration in real uvicorn processes on a real Redis, seen only through HTTP.

Every replica is ``python -m uvicorn replica_app:app`` (``replica_app.py`` next to this file):
heartbeat 0.1 s, lock expiry 0.5 s, one fixed-rate job every 50 ms with a ``Depends``
parameter, and the status router under ``/sj``. The tests read what an operator reads: the
status API, the probes, exit codes and logs. Each replica runs in a session of its own, so
that teardown can SIGKILL a uvicorn with ``--workers`` together with its worker processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import RedisServerFactory, free_port
from waiting import wait_until

from fastapi_singletonjob import HealthStatus, JobStatus, NodeStatus

pytestmark = pytest.mark.redis

TESTS_DIR = Path(__file__).resolve().parent
JOB = "tick"  # replica_app.JOB; not imported, so that this process never builds that app
HEARTBEAT_S = 0.1
LOCK_EXPIRY_S = 0.5
MAX_BACKOFF_S = 1.0
SHUTDOWN_TIMEOUT_S = 1.0

STARTUP_S = 20.0  # several interpreters importing FastAPI at once, on a busy machine
EXIT_S = 10.0
HANDOVER_S = 2.0
UNREADY_S = LOCK_EXPIRY_S + 1.0
READY_AGAIN_S = HEARTBEAT_S + 1.0
"""Readiness is back within a heartbeat and a second of Redis answering again, whatever the
election's backoff (MAX_BACKOFF_S): a probe checks the store itself and wakes the election."""
# Longer than the liveness probe's "wedged" threshold, 2 * (lock expiry + max backoff), so that
# a liveness probe that depended on Redis (directly or through the last success) would fail.
OUTAGE_S = 2 * (LOCK_EXPIRY_S + MAX_BACKOFF_S) + 0.3
HTTP_TIMEOUT_S = 5.0
POLL_S = 0.01
LOG_TAIL_LINES = 25
PORT_ATTEMPTS = 3


@dataclass
class Replica:
    """One ``python -m uvicorn replica_app:app`` process (with its workers, if any)."""

    name: str
    env: dict[str, str]
    workers: int
    log: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    attempts: int = 0
    sigterm_at: float | None = None

    @property
    def url(self) -> str:
        """Base URL of the replica."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The running (or last) process."""
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc

    def spawn(self, workdir: Path) -> None:
        """Start the process on a port that was free a moment ago."""
        self.port = free_port()
        self.attempts += 1
        args = [
            *(sys.executable, "-m", "uvicorn", "replica_app:app"),
            *("--host", "127.0.0.1", "--port", str(self.port), "--no-access-log"),
        ]
        if self.workers > 1:
            args += ["--workers", str(self.workers)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                args,
                cwd=workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def terminate(self) -> None:
        """SIGTERM the uvicorn process, as an orchestrator does."""
        self.sigterm_at = time.monotonic()
        self.process.send_signal(signal.SIGTERM)

    def output(self) -> str:
        """Everything the process and its workers wrote."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the output."""
        return "\n".join(self.output().splitlines()[-lines:])

    def bind_failed(self) -> bool:
        """True when the process exited because another process took its port first."""
        return self.process.poll() is not None and "address already in use" in self.output()

    def kill(self) -> None:
        """SIGKILL the process and its workers (its process group), and reap it."""
        proc = self.proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the session is empty: the process and its workers are gone
        proc.wait(EXIT_S)


@dataclass
class Replicas:
    """The replica processes of one test and an HTTP client for them; :meth:`close` kills
    every process that is left."""

    workdir: Path
    http: httpx.AsyncClient
    started: list[Replica] = field(default_factory=list)

    def start(
        self,
        name: str,
        redis_url: str,
        project: str,
        *,
        workers: int = 1,
        **settings: str,
    ) -> Replica:
        """Start a replica; ``settings`` are more ``SINGLETONJOB_*`` variables (without the
        prefix)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SINGLETONJOB_")}
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")])),
            PYTHONUNBUFFERED="1",
            SINGLETONJOB_REDIS_URL=redis_url,
            SINGLETONJOB_PROJECT=project,
            SINGLETONJOB_HEARTBEAT_INTERVAL=str(HEARTBEAT_S),
            SINGLETONJOB_LOCK_EXPIRY=str(LOCK_EXPIRY_S),
            SINGLETONJOB_SHUTDOWN_TIMEOUT=str(SHUTDOWN_TIMEOUT_S),
        )
        env.update({f"SINGLETONJOB_{key}": value for key, value in settings.items()})
        replica = Replica(name, env, workers, self.workdir / f"{name}.log")
        replica.spawn(self.workdir)
        self.started.append(replica)
        return replica

    async def get(self, replica: Replica, path: str) -> httpx.Response | None:
        """GET ``path`` on a new connection; None when the replica does not answer."""
        try:
            return await self.http.get(replica.url + path)
        except httpx.TransportError:
            return None

    async def ledger(self, replica: Replica) -> dict[str, Any]:
        """The replica app's ``/ledger``: what the job did in that process."""
        response = await self.get(replica, "/ledger")
        assert response is not None and response.status_code == 200, (replica.name, response)
        book: dict[str, Any] = response.json()
        return book

    async def status(self, replica: Replica) -> NodeStatus | None:
        """The replica's ``/sj/jobs`` answer, parsed by the library's own model."""
        response = await self.get(replica, "/sj/jobs")
        if response is None:
            return None
        assert response.status_code == 200, f"{replica.name}: {response.text}"
        return NodeStatus.model_validate_json(response.content)

    async def probe(self, replica: Replica, path: str) -> tuple[int, HealthStatus]:
        """A probe's status code and body; the replica must answer."""
        response = await self.get(replica, path)
        assert response is not None, f"{replica.name} did not answer {path}\n{self.describe()}"
        return response.status_code, HealthStatus.model_validate_json(response.content)

    def check_running(self, replica: Replica) -> bool:
        """Fail the test when the replica has exited, unless it lost its port to another
        process, in which case it is started again on a new port (returns False)."""
        if replica.process.poll() is None:
            return True
        if replica.bind_failed() and replica.attempts < PORT_ATTEMPTS:
            replica.spawn(self.workdir)
            return False
        raise AssertionError(
            f"{replica.name} exited with {replica.process.returncode}\n{self.describe()}"
        )

    async def wait_answering(self, *replicas: Replica) -> None:
        """Until each replica answers HTTP at all: uvicorn serves only after the lifespan's
        startup has completed."""

        async def answers(replica: Replica) -> bool:
            return self.check_running(replica) and (
                await self.get(replica, "/sj/health/live") is not None
            )

        await self._all(answers, replicas, STARTUP_S, "every replica answers HTTP")

    async def wait_ready(self, *replicas: Replica, timeout_s: float = STARTUP_S) -> float:
        """Until each replica's strict readiness probe (the job system is up) answers 200;
        returns when that was seen."""

        async def ready(replica: Replica) -> bool:
            if not self.check_running(replica):
                return False
            response = await self.get(replica, "/sj/health/jobs")
            return response is not None and response.status_code == 200

        return await self._all(ready, replicas, timeout_s, "/sj/health/jobs is 200 everywhere")

    async def _all(
        self,
        predicate: Callable[[Replica], Awaitable[bool]],
        replicas: tuple[Replica, ...],
        timeout_s: float,
        what: str,
    ) -> float:
        async def all_true() -> bool:
            return all(await asyncio.gather(*(predicate(r) for r in replicas)))

        try:
            return await wait_until(all_true, timeout_s, what, poll_s=POLL_S)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None

    def describe(self) -> str:
        """Ports, exit codes and output tails of every replica, for assertion messages."""
        parts = []
        for r in self.started:
            code = r.proc.poll() if r.proc is not None else None
            parts.append(f"--- {r.name} (port {r.port}, exit {code}):\n{r.tail()}")
        return "\n".join(parts)

    def close(self) -> None:
        """Kill every process started, with its workers."""
        for replica in self.started:
            replica.kill()


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Replicas]:
    # "Connection: close": every request opens a connection of its own, so that a uvicorn
    # with several workers balances them, and a stopping replica holds no idle connection.
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, headers={"Connection": "close"}) as client:
        cluster = Replicas(tmp_path, client)
        try:
            yield cluster
        finally:
            cluster.close()


def job_of(status: NodeStatus) -> JobStatus:
    """The one job of the replica app."""
    (job,) = status.jobs
    assert job.name == JOB, status
    return job


async def statuses(cluster: Replicas, *replicas: Replica) -> dict[str, NodeStatus]:
    """Every replica's ``/sj/jobs``, by replica name; each must answer."""
    answers = await asyncio.gather(*(cluster.status(r) for r in replicas))
    missing = [r.name for r, a in zip(replicas, answers, strict=True) if a is None]
    assert not missing, f"no /sj/jobs answer from {missing}\n{cluster.describe()}"
    return {r.name: a for r, a in zip(replicas, answers, strict=True) if a is not None}


def assert_one_leader(views: dict[str, NodeStatus], context: str) -> tuple[str, int]:
    """All views name the same leader and token, and exactly that node says it leads;
    returns the leader's node id and token."""
    jobs = {name: job_of(view) for name, view in views.items()}
    claims = {(job.leader, job.fencing_token) for job in jobs.values()}
    assert len(claims) == 1, f"replicas disagree on the leader: {jobs}\n{context}"
    ((leader, token),) = claims
    assert leader is not None and token is not None, f"no leader: {jobs}\n{context}"
    leading = [views[name].node_id for name, job in jobs.items() if job.is_leader]
    assert leading == [leader], f"{leading} claim to lead, all name {leader}\n{context}"
    return leader, token


async def wait_one_leader(cluster: Replicas, nodes: list[Replica]) -> tuple[str, int]:
    """Wait (bounded) until one replica leads, then check that all agree on it."""

    async def one_leader() -> bool:
        # Followers learn the leader on their next round, so wait until every view names it.
        views = await statuses(cluster, *nodes)
        jobs = [job_of(v) for v in views.values()]
        return sum(j.is_leader for j in jobs) == 1 and len({j.leader for j in jobs}) == 1

    await wait_until(one_leader, HANDOVER_S, "one replica leads", poll_s=POLL_S)
    return assert_one_leader(await statuses(cluster, *nodes), cluster.describe())


async def test_three_replicas_agree_and_sigterm_hands_over(
    replicas: Replicas, redis_url: str, unique_project: str
) -> None:
    nodes = [replicas.start(f"r{i}", redis_url, unique_project) for i in (1, 2, 3)]
    await replicas.wait_ready(*nodes)

    views = await statuses(replicas, *nodes)
    node_ids = {name: view.node_id for name, view in views.items()}
    assert len(set(node_ids.values())) == 3, node_ids
    assert all(view.started and view.store.reachable for view in views.values()), views
    leader_id, token = await wait_one_leader(replicas, nodes)
    (leader,) = [r for r in nodes if node_ids[r.name] == leader_id]
    followers = [r for r in nodes if r is not leader]

    # The job runs on the leader only, with its Depends parameter resolved by FastAPI.
    async def leader_ran() -> bool:
        response = await replicas.get(leader, "/ledger")
        return response is not None and response.json()["runs"] >= 3

    await wait_until(leader_ran, 2.0, "three runs on the leader", poll_s=POLL_S)
    books = {r.name: await replicas.ledger(r) for r in nodes}
    assert books[leader.name]["last_token"] == token, books
    assert books[leader.name]["last_node"] == leader_id, books
    assert [books[r.name]["runs"] for r in followers] == [0, 0], books
    reported = job_of((await statuses(replicas, leader))[leader.name])
    assert reported.runs >= 3 and reported.failures == 0, reported

    leader.terminate()
    successor: dict[str, NodeStatus] = {}
    exited_at: list[float] = []

    async def taken_over() -> bool:
        if not exited_at and leader.process.poll() is not None:
            exited_at.append(time.monotonic())
        for name, view in (await statuses(replicas, *followers)).items():
            if job_of(view).is_leader:
                successor[name] = view
        return bool(successor)

    seen_at = await wait_until(taken_over, HANDOVER_S, "a follower leads", poll_s=POLL_S)
    assert leader.sigterm_at is not None
    if not exited_at:
        exited_at.append(
            await wait_until(
                lambda: leader.process.poll() is not None, EXIT_S, "the old leader exits"
            )
        )
    print(
        f"SIGTERM handover: a follower reported is_leader {(seen_at - leader.sigterm_at) * 1e3:.0f}"
        f" ms after SIGTERM; the old leader had exited by "
        f"{(exited_at[0] - leader.sigterm_at) * 1e3:.0f} ms"
    )
    assert exited_at[0] - leader.sigterm_at < EXIT_S
    assert len(successor) == 1, successor
    new_token = job_of(next(iter(successor.values()))).fencing_token
    assert new_token is not None and new_token > token, (token, successor)
    # uvicorn re-raises the SIGTERM after a complete graceful shutdown (since 0.29), so a
    # clean stop ends "killed by SIGTERM"; a failed one exits 3 or logs a failure.
    output = leader.output()
    assert leader.process.returncode == -signal.SIGTERM, replicas.describe()
    assert "Application shutdown complete." in output, replicas.describe()
    assert f"node {leader_id} released leadership of {JOB}" in output, replicas.describe()
    assert "Traceback" not in output, replicas.describe()

    # The other follower learns the new term too.
    async def survivors_agree() -> bool:
        views = await statuses(replicas, *followers)
        return len({(job_of(v).leader, job_of(v).fencing_token) for v in views.values()}) == 1

    await wait_until(survivors_agree, HANDOVER_S, "the survivors agree", poll_s=POLL_S)
    assert_one_leader(await statuses(replicas, *followers), replicas.describe())


async def test_two_workers_of_one_uvicorn_are_two_nodes(
    replicas: Replicas, redis_url: str, unique_project: str
) -> None:
    server = replicas.start("workers", redis_url, unique_project, workers=2)
    answers: list[NodeStatus] = []

    async def both_workers_answered() -> bool:
        replicas.check_running(server)
        status = await replicas.status(server)
        # Counted once elected: a worker's first round only looks at a free lock
        # (placement learns the members first), so it may answer before any leader exists.
        if status is not None and status.store.reachable and job_of(status).leader is not None:
            answers.append(status)
        return len({a.node_id for a in answers}) == 2

    try:
        await wait_until(both_workers_answered, STARTUP_S, "two node ids", poll_s=POLL_S)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; answers from {[a.node_id for a in answers]}") from None

    by_node = {a.node_id: a for a in answers}
    print(f"{len(answers)} answers: {sorted(by_node)}")
    claims = {(job_of(a).leader, job_of(a).fencing_token) for a in answers}
    assert len(claims) == 1, f"the workers disagree on the leader: {claims}"
    ((leader, token),) = claims
    assert leader in by_node and token is not None, (claims, sorted(by_node))
    leading = {a.node_id for a in answers if job_of(a).is_leader}
    assert leading == {leader}, (leading, leader)

    server.terminate()
    await wait_until(lambda: server.process.poll() is not None, EXIT_S, "uvicorn exits")
    output = server.output()
    assert server.process.returncode == 0, replicas.describe()
    assert output.count("Application shutdown complete.") == 2, replicas.describe()
    for node in by_node:
        assert f"singletonjob node {node} stopped" in output, replicas.describe()
    assert f"node {leader} released leadership of {JOB}" in output, replicas.describe()


async def probe_round(cluster: Replicas, nodes: list[Replica]) -> dict[str, tuple[int, str]]:
    """The strict readiness (``/sj/health/jobs``) of every replica, after checking that
    liveness, the default readiness (``/sj/health``: serve HTTP, report degraded jobs) and the
    application's own route answer 200; returns ``{name: (strict code, reason)}``."""
    result = {}
    for replica in nodes:
        live, own = await asyncio.gather(
            cluster.probe(replica, "/sj/health/live"), cluster.get(replica, "/ledger")
        )
        # One after the other: the two readiness routes agree unless the state changed in
        # between, which a second strict probe shows.
        ready = await cluster.probe(replica, "/sj/health/jobs")
        serving = await cluster.probe(replica, "/sj/health")
        again = await cluster.probe(replica, "/sj/health/jobs")
        assert live[0] == 200, f"{replica.name} liveness: {live}\n{cluster.describe()}"
        assert serving[0] == 200, f"{replica.name} left rotation: {serving}"
        if again[0] == ready[0]:
            assert serving[1].status == ("ok" if ready[0] == 200 else "degraded"), serving
        assert own is not None and own.status_code == 200, f"{replica.name} /ledger: {own}"
        result[replica.name] = (ready[0], ready[1].reason or "")
    return result


async def test_memory_store_under_uvicorn_workers_is_an_error_naming_them(
    replicas: Replicas, unique_project: str
) -> None:
    """``memory://`` elects within one process: under ``uvicorn --workers 2`` both workers run
    every job. Each worker says so at ERROR, naming the server; a lone uvicorn gets the plain
    WARNING."""
    several = replicas.start("workers", "memory://", unique_project, workers=2)
    alone = replicas.start("alone", "memory://", unique_project)
    loud = "is one of 2 workers of uvicorn --workers 2: each of the 2 runs every job"

    def said() -> bool:
        replicas.check_running(several)
        replicas.check_running(alone)
        return several.output().count(loud) == 2 and "elects within" in alone.output()

    await wait_until(said, STARTUP_S, "both workers and the lone uvicorn warn", poll_s=POLL_S)
    lines = [line for line in several.output().splitlines() if loud in line]
    assert all(" ERROR " in line for line in lines), lines
    assert len({line.split("(pid ")[1].split(")")[0] for line in lines}) == 2, lines
    (warning,) = [line for line in alone.output().splitlines() if "elects within" in line]
    assert " WARNING " in warning and "every worker and replica runs every job" in warning
    assert "workers of" not in warning, warning


async def test_probes_follow_a_redis_outage(
    replicas: Replicas, fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    server = fresh_redis()
    nodes = [
        replicas.start(f"r{i}", server.url, unique_project, MAX_BACKOFF=str(MAX_BACKOFF_S))
        for i in (1, 2)
    ]
    await replicas.wait_ready(*nodes)
    _, token_before = await wait_one_leader(replicas, nodes)

    killed_at = time.monotonic()
    server.kill()
    unready_at: dict[str, float] = {}

    async def all_unready() -> bool:
        for name, (code, reason) in (await probe_round(replicas, nodes)).items():
            if code == 503 and name not in unready_at:
                assert "lease store" in reason, reason
                unready_at[name] = time.monotonic() - killed_at
        return len(unready_at) == len(nodes)

    await wait_until(all_unready, UNREADY_S, "/sj/health/jobs is 503 everywhere", poll_s=POLL_S)

    # Through the outage: never ready again, always alive, serving, and no node leads.
    while time.monotonic() - killed_at < OUTAGE_S:
        for name, (code, reason) in (await probe_round(replicas, nodes)).items():
            assert code == 503, f"{name} is ready while Redis is down: {reason}"
        if time.monotonic() - killed_at > LOCK_EXPIRY_S + HEARTBEAT_S:
            views = await statuses(replicas, *nodes)
            assert not any(job_of(v).is_leader for v in views.values()), views
        await asyncio.sleep(POLL_S)

    server.restart()
    restarted_at = time.monotonic()
    ready_at = await replicas.wait_ready(*nodes, timeout_s=READY_AGAIN_S)
    print(
        "Redis outage: /sj/health/jobs 503 after "
        + ", ".join(f"{name} {s * 1000:.0f} ms" for name, s in sorted(unready_at.items()))
        + f"; 200 again {(ready_at - restarted_at) * 1000:.0f} ms after the restart"
    )

    _, token_after = await wait_one_leader(replicas, nodes)
    assert token_after > token_before  # the fence key was lost; the server-time floor holds


@pytest.mark.parametrize("outage", ["killed", "paused"])
async def test_replicas_start_and_serve_while_redis_is_down(
    replicas: Replicas, fresh_redis: RedisServerFactory, unique_project: str, outage: str
) -> None:
    server = fresh_redis()
    if outage == "killed":
        server.kill()  # the port refuses connections
    else:
        server.pause()  # connections are accepted and never answered: every call times out
    nodes = [
        replicas.start(f"r{i}", server.url, unique_project, MAX_BACKOFF=str(MAX_BACKOFF_S))
        for i in (1, 2)
    ]
    await replicas.wait_answering(*nodes)  # so the lifespan's startup did not wait for Redis
    assert all("Application startup complete." in r.output() for r in nodes)

    async def tried_and_failed() -> bool:
        views = await statuses(replicas, *nodes)
        return all(view.store.consecutive_failures > 0 for view in views.values())

    await wait_until(tried_and_failed, UNREADY_S, "a failed election round", poll_s=POLL_S)
    for name, (code, reason) in (await probe_round(replicas, nodes)).items():
        assert code == 503, f"{name} is ready without Redis"
        assert "lease store has not answered yet" in reason, reason
    for view in (await statuses(replicas, *nodes)).values():
        job = job_of(view)
        assert view.started and not view.store.reachable and view.store.error, view
        assert (job.leader, job.is_leader, job.runs) == (None, False, 0), job

    if outage == "killed":
        server.restart()
    else:
        server.resume()
    up_at = time.monotonic()
    ready_at = await replicas.wait_ready(*nodes, timeout_s=READY_AGAIN_S)
    print(f"started with Redis {outage}: 200 {(ready_at - up_at) * 1000:.0f} ms after it was back")

    await wait_one_leader(replicas, nodes)
