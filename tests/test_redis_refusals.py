"""Permanent store errors (issue 29, item 7), on a real redis-server with ``requirepass`` and
ACL users: a password missing or wrong, a database index out of range, a missing ACL
permission. The node logs one ERROR with the fix (not redis-py's "HELLO must be called ..."),
readiness says so, the rounds back off longer but the node leads as soon as the server is
fixed, and the CLI says "refused", not "did not answer". No text shows the password."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import httpx
import pytest
from fastapi import FastAPI
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from servers import RedisServer, RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._cli import EXIT_UNREACHABLE, main
from fastapi_singletonjob._store.refusals import refusal
from fastapi_singletonjob._timing import next_attempt_delay, refused_backoff_s

pytestmark = pytest.mark.redis

PASSWORD = "Pa55-w0rd-xyz"
WRONG = "Wr0ng-pa55-abc"
USER_PASSWORD = "us3r-pa55-def"
HEARTBEAT_S = 0.1
MAX_BACKOFF_S = 0.2


@pytest.fixture
def server(fresh_redis: RedisServerFactory) -> Iterator[RedisServer]:
    """A server with a password for the default user and two ACL users: ``noeval`` may not
    run scripts, ``nokeys`` may touch no key of the library."""
    server = fresh_redis(extra_args=["--requirepass", PASSWORD])
    with server.client() as admin:
        for user, rules in (
            ("noeval", ["~*", "&*", "+@all", "-evalsha", "-eval"]),
            ("nokeys", ["~other:*", "&*", "+@all"]),
        ):
            admin.execute_command("ACL", "SETUSER", user, "on", f">{USER_PASSWORD}", *rules)
    yield server


URL = Callable[[RedisServer], str]
CASES: list[tuple[str, URL, str, str]] = [
    (
        "no-password",
        lambda s: f"redis://127.0.0.1:{s.port}/0",
        "a password is required, and the URL gives none (NOAUTH)",
        "put the password in the URL: redis://:PASSWORD@host:6379/0",
    ),
    (
        "wrong-password",
        lambda s: f"redis://:{WRONG}@127.0.0.1:{s.port}/0",
        "wrong user name or password (WRONGPASS)",
        "check them, percent-encoded, in the URL",
    ),
    (
        "db-out-of-range",
        lambda s: f"redis://:{PASSWORD}@127.0.0.1:{s.port}/99",
        "the database index of the URL is out of range",
        "use one below the server's 'databases' setting",
    ),
    (
        "acl-no-scripts",
        lambda s: f"redis://noeval:{USER_PASSWORD}@127.0.0.1:{s.port}/0",
        "the ACL user lacks a permission (NOPERM: this user has no permissions to run the "
        "'evalsha' command)",
        "give the user the ACL rule of the docs",
    ),
    (
        "acl-no-keys",
        lambda s: f"redis://nokeys:{USER_PASSWORD}@127.0.0.1:{s.port}/0",
        "the ACL user lacks a permission (NOPERM: this user has no permissions to access one "
        "of the keys used as arguments)",
        "~singletonjob:{PROJECT}:*",
    ),
]


def node(url: str, max_backoff_s: float = MAX_BACKOFF_S) -> SingletonJobs:
    jobs = SingletonJobs(
        url,
        project="refused",
        node_id="n1",
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=0.5,
        max_backoff=max_backoff_s,
    )

    @jobs.interval("sweep", every=1.0)
    async def sweep() -> None:
        pass

    return jobs


def no_secret(text: str) -> None:
    for secret in (PASSWORD, WRONG, USER_PASSWORD):
        assert secret not in text, text


@pytest.mark.parametrize(
    ("url", "what", "fix"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
async def test_a_refused_node_says_what_to_fix_once_at_error_and_in_readiness(
    server: RedisServer,
    url: URL,
    what: str,
    fix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="fastapi_singletonjob")
    jobs = node(url(server))
    app = FastAPI()
    app.include_router(jobs.router)
    async with (
        jobs,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as http,
    ):
        # Three refused rounds: the ERROR is said once, not at each.
        await wait_until(lambda: jobs.status().store.consecutive_failures >= 3, 5.0, "3 rounds")
        store = jobs.status().store
        assert store.refused is not None and store.refused.startswith(what), store
        assert fix in store.refused and store.error is not None and what in store.error
        # Readiness: /health stays 200 but degraded, /health/jobs (strict) is 503; both say why.
        ready, strict = await http.get("/health"), await http.get("/health/jobs")
        assert (ready.status_code, ready.json()["status"]) == (200, "degraded"), ready.text
        assert (strict.status_code, strict.json()["status"]) == (503, "unavailable")
        for reason in (ready.json()["reason"], strict.json()["reason"]):
            assert reason.startswith("Redis refuses this node, no retry mends it: " + what)
            assert fix in reason
        status = await http.get("/jobs")
        no_secret(ready.text + strict.text + status.text)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert f"node n1: Redis refused the election (attempt 1): {what}" in errors[0]
    assert fix in errors[0] and "No retry mends this" in errors[0]
    assert not any("HELLO must be called" in r.getMessage() for r in caplog.records)
    no_secret("\n".join(r.getMessage() for r in caplog.records))


async def test_a_fixed_server_is_led_at_once_despite_the_long_backoff(
    server: RedisServer,
) -> None:
    """The rounds of a refused node back off up to twice ``max_backoff``, but the release
    listener, which tries every heartbeat, wakes the election as soon as Redis lets it in."""
    with server.client() as admin:  # connected before the password changes
        jobs = node(f"redis://:{WRONG}@127.0.0.1:{server.port}/0", max_backoff_s=30.0)
        async with jobs:
            await wait_until(lambda: jobs.status().store.refused is not None, 5.0, "refused")
            admin.config_set("requirepass", WRONG)  # the operator makes the URL right
            await wait_until(
                lambda: jobs.status().jobs[0].is_leader, 3 * HEARTBEAT_S + 1.0, "leads"
            )
            store = jobs.status().store
            assert store.refused is None and store.error is None, store


def test_the_refused_backoff_is_longer_and_jittered() -> None:
    def delay(jitter: float, *, refused: bool, leading: bool = False) -> float:
        return next_attempt_delay(
            heartbeat_s=1.0,
            max_backoff_s=30.0,
            failures=9,
            jitter=jitter,
            refused=refused,
            leading=leading,
        )

    assert delay(0.0, refused=False) == 15.0
    assert delay(0.0, refused=True) == 30.0
    assert delay(0.999999, refused=True) == pytest.approx(60.0)
    assert refused_backoff_s(30.0) == 60.0
    # A leader keeps renewing at the heartbeat, refused or not: its lease must not lapse.
    assert delay(0.5, refused=True, leading=True) == 1.0


def test_errors_that_pass_are_no_refusal() -> None:
    for exc in (
        RedisConnectionError("Error 111 connecting"),
        RedisTimeoutError("Timeout reading from socket"),
        ResponseError("LOADING Redis is loading the dataset in memory"),
        OSError("reset"),
    ):
        assert refusal(exc) is None, exc


@pytest.mark.parametrize(
    ("url", "what", "fix"),
    [case[1:] for case in CASES if case[0] != "acl-no-scripts"],  # status runs no script
    ids=[case[0] for case in CASES if case[0] != "acl-no-scripts"],
)
def test_the_cli_says_refused_where_redis_answered(
    server: RedisServer, url: URL, what: str, fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    given = url(server)
    assert main(["--redis-url", given, "--project", "refused", "status"]) == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "did not answer" not in err and "HELLO must be called" not in err, err
    assert f" refused: {what}" in err and fix in err, err
    no_secret(err)


def test_the_cli_still_says_did_not_answer_where_redis_did_not(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    port = server.port
    server.stop()
    given = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    assert main(["--redis-url", given, "--project", "refused", "status"]) == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "did not answer: ConnectionError" in err and "refused:" not in err, err
    no_secret(err)
