"""TLS for real: a redis-server with a TLS port that requires client certificates, with a CA,
a server certificate and a client certificate made by ``trustme``, reached through the
documented ``rediss://...?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...`` URL. A client
that trusts another CA is reported by readiness, with the TLS error as the reason.

The server also listens on a plain port: the test harness (``RedisServer``) checks with it
that the server is up; the library only ever gets the TLS port."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trustme
from fastapi import FastAPI
from servers import HOST, RedisServerFactory, free_port
from waiting import wait_until

from fastapi_singletonjob import SingletonJobs

pytestmark = pytest.mark.redis

HEARTBEAT_S = 0.1
LOCK_EXPIRY_S = 0.5
MAX_BACKOFF_S = 0.3
PREFIX = "/singletonjob"
KEY_PASSPHRASE = "k3y-s3cret"


def write_pems(directory: Path, ca: trustme.CA) -> dict[str, Path]:
    """The CA, a server certificate for 127.0.0.1 and a client certificate, as files."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {name: directory / f"{name}.pem" for name in ("ca", "server", "server-key")}
    files |= {"client": directory / "client.pem", "client-key": directory / "client-key.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server = ca.issue_cert(HOST, "localhost")
    server.private_key_pem.write_to_path(str(files["server-key"]))
    server.cert_chain_pems[0].write_to_path(str(files["server"]))
    client = ca.issue_cert("singletonjob-client")
    client.private_key_pem.write_to_path(str(files["client-key"]))
    client.cert_chain_pems[0].write_to_path(str(files["client"]))
    return files


def tls_url(port: int, pems: dict[str, Path], *, ca: Path | None = None) -> str:
    return (
        f"rediss://{HOST}:{port}/0?ssl_ca_certs={ca or pems['ca']}"
        f"&ssl_certfile={pems['client']}&ssl_keyfile={pems['client-key']}"
    )


def start_tls_server(fresh_redis: RedisServerFactory, pems: dict[str, Path]) -> int:
    """A server whose TLS port requires a client certificate of the CA; that port."""
    tls_port = free_port()
    fresh_redis(
        extra_args=[
            *("--tls-port", str(tls_port)),
            *("--tls-cert-file", str(pems["server"]), "--tls-key-file", str(pems["server-key"])),
            *("--tls-ca-cert-file", str(pems["ca"]), "--tls-auth-clients", "yes"),
        ]
    )
    return tls_port


def node(url: str, project: str, name: str, runs: list[str]) -> SingletonJobs:
    jobs = SingletonJobs(
        url,
        project=project,
        node_id=name,
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
        max_backoff=MAX_BACKOFF_S,
        shutdown_timeout=1.0,
    )

    @jobs.interval("tick", every=0.05)
    async def tick() -> None:
        runs.append(name)

    return jobs


@contextlib.asynccontextmanager
async def serve(jobs: SingletonJobs) -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI(lifespan=jobs.lifespan)
    app.include_router(jobs.router, prefix=PREFIX)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://node") as client,
    ):
        yield client


async def tls_error_reported(client: httpx.AsyncClient, timeout_s: float) -> list[str]:
    """Poll readiness (503 all along) until its reason names the TLS error; the reasons."""
    reasons: list[str] = []

    async def names_the_tls_error() -> bool:
        response = await client.get(f"{PREFIX}/health/jobs")
        assert response.status_code == 503, response.text
        reasons.append(response.json()["reason"])
        return "CERTIFICATE_VERIFY_FAILED" in reasons[-1]

    await wait_until(names_the_tls_error, timeout_s, f"readiness names the TLS error: {reasons}")
    return reasons


async def test_rediss_with_a_ca_and_a_client_certificate_elects_and_hands_over(
    fresh_redis: RedisServerFactory, tmp_path: Path, unique_project: str
) -> None:
    pems = write_pems(tmp_path / "pki", trustme.CA())
    port = start_tls_server(fresh_redis, pems)
    url = tls_url(port, pems)
    runs: list[str] = []
    a, b = node(url, unique_project, "a", runs), node(url, unique_project, "b", runs)
    async with a, b:
        await wait_until(lambda: len(runs) >= 3, 5.0, "runs over TLS")
        leader, follower = (a, b) if a.status().jobs[0].is_leader else (b, a)
        assert not follower.status().jobs[0].is_leader
        stopped_at = time.monotonic()
        await leader.stop()
        await wait_until(lambda: follower.status().jobs[0].is_leader, 2.0, "the follower leads")
        assert follower.status().store.error is None
        # Pushed, not polled: the follower heard the release notice (a bound on the time it
        # took failed on a busy machine, where the stop itself can take longer).
        assert follower.engine is not None
        notice_at = follower.engine.elector._notice_at
    assert notice_at is not None and notice_at >= stopped_at, "the release notice arrives over TLS"


async def test_a_certificate_of_another_ca_is_reported_by_readiness(
    fresh_redis: RedisServerFactory, tmp_path: Path, unique_project: str
) -> None:
    pems = write_pems(tmp_path / "pki", trustme.CA())
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    port = start_tls_server(fresh_redis, pems)
    runs: list[str] = []
    jobs = node(tls_url(port, pems, ca=other_ca), unique_project, "a", runs)

    async with serve(jobs) as client:
        # The first round may time out instead: 0.1 s (the heartbeat) is the connect timeout,
        # and the first TLS context takes a while to load on a busy machine.
        reasons = await tls_error_reported(client, 5.0)
        live = await client.get(f"{PREFIX}/health/live")
    assert reasons[-1].startswith("the lease store has not answered yet"), reasons[-1]
    assert live.status_code == 200, "a TLS mismatch is not a liveness failure"
    assert runs == []


async def test_the_key_passphrase_in_the_url_is_never_shown(
    fresh_redis: RedisServerFactory, tmp_path: Path, unique_project: str
) -> None:
    """``ssl_password`` (the client key's passphrase) is a secret: the status and the repr
    show ``ssl_password=***``, while the file paths stay readable."""
    pems = write_pems(tmp_path / "pki", trustme.CA())
    port = start_tls_server(fresh_redis, pems)
    url = tls_url(port, pems) + f"&ssl_password={KEY_PASSPHRASE}"
    runs: list[str] = []
    jobs = node(url, unique_project, "a", runs)
    async with serve(jobs) as client:
        await wait_until(lambda: bool(runs), 5.0, "a run")
        body = (await client.get(f"{PREFIX}/jobs")).text
    shown = repr(jobs.settings) + body
    assert KEY_PASSPHRASE not in shown
    assert "ssl_password=***" in repr(jobs.settings)
    assert str(pems["ca"]) in repr(jobs.settings)
