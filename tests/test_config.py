"""Configuration: precedence, validation at definition time, secrets, node ids, public surface.

Nothing here connects to Redis or sleeps: building a ``SingletonJobs`` only validates settings.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest
import redis
import redis.asyncio

import fastapi_singletonjob
from fastapi_singletonjob import (
    ConfigurationError,
    Cron,
    FixedRate,
    Interval,
    JobContext,
    SingletonJobError,
    SingletonJobs,
)
from fastapi_singletonjob._config.settings import ENV_SETTINGS, Settings, min_lock_expiry_s
from fastapi_singletonjob._timing import lease_deadline

LOGGER = "fastapi_singletonjob"
ENV = "SINGLETONJOB_"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's or CI's own ``SINGLETONJOB_*`` variables must not leak into tests."""
    for name in list(os.environ):
        if name.startswith(ENV):
            monkeypatch.delenv(name)


def build(**overrides: Any) -> SingletonJobs:
    """A ``SingletonJobs`` on the in-memory store; ``overrides`` replace any argument."""
    kwargs: dict[str, Any] = {"redis_url": "memory://", "project": "p"}
    kwargs.update(overrides)
    return SingletonJobs(**kwargs)


def bad(value: object) -> Any:
    """Pass a value of the wrong type without a ``type: ignore`` at every call."""
    return value


def noop() -> None:
    """A job that does nothing."""


async def async_noop(ctx: JobContext) -> None:
    """An async job that takes its context."""


def with_context(ctx: JobContext, *args: object, retries: int = 3, **kwargs: object) -> None:
    """Every resolvable kind of parameter: the context, defaults, *args and **kwargs."""


def needs_value(ctx: JobContext, value: int) -> None:
    """``value`` has no default and is not a JobContext: nothing could fill it."""


def needs_keyword(*, limit: int) -> None:
    """A keyword-only parameter without a default cannot be filled either."""


class EveryMinute:
    """A user-defined schedule: any object with ``next_fire``."""

    def next_fire(self, after: Any) -> Any:
        return after + timedelta(minutes=1)


class NextFireNotCallable:
    """Has a ``next_fire`` attribute, but it is not a method."""

    next_fire = "daily"


def generator_job(retries: int = 3) -> Iterator[None]:
    """A ``def`` with ``yield``: calling it only makes a generator, its body never runs."""
    yield


async def async_generator_job() -> AsyncIterator[None]:
    """An ``async def`` with ``yield``: calling it only makes an async generator."""
    yield


class GeneratorCallable:
    """A callable object whose ``__call__`` is a generator function."""

    def __call__(self) -> Iterator[None]:
        yield


# -- precedence: explicit argument > SINGLETONJOB_* > default ----------------------------------


@dataclass(frozen=True)
class Setting:
    arg: str
    """Keyword of ``SingletonJobs``; the environment variable is ``SINGLETONJOB_<ARG>``."""
    attr: str
    """Attribute of ``Settings`` it ends up in."""
    env_value: str
    from_env: object
    explicit: object
    from_explicit: object


SETTINGS = [
    Setting(
        "redis_url",
        "redis_url",
        "redis://env-host:6380/1",
        "redis://env-host:6380/1",
        "rediss://arg-host:6390/2",
        "rediss://arg-host:6390/2",
    ),
    Setting("project", "project", "env-project", "env-project", "arg.project", "arg.project"),
    Setting("node_id", "node_id", "env-node", "env-node", "arg-node", "arg-node"),
    Setting("heartbeat_interval", "heartbeat_interval_s", "2", 2.0, 1.5, 1.5),
    Setting("lock_expiry", "lock_expiry_s", "12.5", 12.5, timedelta(seconds=20), 20.0),
    Setting("max_backoff", "max_backoff_s", "45", 45.0, 60, 60.0),
    Setting("shutdown_timeout", "shutdown_timeout_s", "0", 0.0, 2.5, 2.5),
]
SETTING_IDS = [s.arg for s in SETTINGS]

DEFAULTS = [
    pytest.param("redis_url", "redis://localhost:6379/0", id="redis_url"),
    pytest.param("heartbeat_interval_s", 3.0, id="heartbeat_interval"),
    pytest.param("lock_expiry_s", 10.0, id="lock_expiry"),
    pytest.param("max_backoff_s", 30.0, id="max_backoff"),
    pytest.param("shutdown_timeout_s", 10.0, id="shutdown_timeout"),
]


@pytest.mark.parametrize(("attr", "expected"), DEFAULTS)
def test_default_applies_without_argument_or_env(attr: str, expected: object) -> None:
    jobs = build(redis_url=None)
    assert getattr(jobs.settings, attr) == expected


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_env_var_applies_without_argument(
    setting: Setting, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV + setting.arg.upper(), setting.env_value)
    jobs = build(**{setting.arg: None})
    assert getattr(jobs.settings, setting.attr) == setting.from_env


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_explicit_argument_beats_env_var(setting: Setting, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV + setting.arg.upper(), setting.env_value)
    jobs = build(**{setting.arg: setting.explicit})
    assert getattr(jobs.settings, setting.attr) == setting.from_explicit


def test_explicit_argument_shadows_an_invalid_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV + "LOCK_EXPIRY", "abc")
    assert build(lock_expiry=15).settings.lock_expiry_s == 15.0


def test_project_and_node_id_properties_mirror_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV + "PROJECT", "from-env")
    jobs = build(project=None, node_id="n-1")
    assert (jobs.project, jobs.node_id) == ("from-env", "n-1")


def test_redis_client_leaves_redis_url_unset() -> None:
    client = redis.asyncio.Redis()
    jobs = SingletonJobs(redis=client, project="p")
    assert jobs.settings.redis_url is None


@pytest.mark.parametrize("arg", ["heartbeat_interval", "lock_expiry", "max_backoff"])
@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        pytest.param(timedelta(seconds=5), 5.0, id="timedelta"),
        pytest.param(timedelta(milliseconds=4500), 4.5, id="timedelta-fraction"),
        pytest.param(5, 5.0, id="int"),
        pytest.param(4.5, 4.5, id="float"),
    ],
)
def test_duration_accepts_timedelta_int_and_float(arg: str, value: object, seconds: float) -> None:
    # A 1 s heartbeat and a 30 s lease, so that each value is valid in every role.
    kwargs: dict[str, Any] = {"heartbeat_interval": 1, "lock_expiry": 30, arg: value}
    result = getattr(build(**kwargs).settings, arg + "_s")
    assert type(result) is float
    assert result == seconds


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(0, id="int"),
        pytest.param(0.0, id="float"),
        pytest.param(timedelta(0), id="timedelta"),
        pytest.param(None, id="env"),
    ],
)
def test_zero_shutdown_timeout_is_allowed(value: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV + "SHUTDOWN_TIMEOUT", "0")
    assert build(shutdown_timeout=value).settings.shutdown_timeout_s == 0.0


@pytest.mark.parametrize(
    ("variable", "nearest"),
    [
        pytest.param("LOCKEXPIRY", "SINGLETONJOB_LOCK_EXPIRY", id="missing-underscore"),
        pytest.param("LOCK_EXPIRY_S", "SINGLETONJOB_LOCK_EXPIRY", id="unit-suffix"),
        pytest.param("REDIS", "SINGLETONJOB_REDIS_URL", id="truncated"),
        pytest.param("HEARTBEAT", "SINGLETONJOB_HEARTBEAT_INTERVAL", id="first-word"),
        pytest.param("TIMEOUT", "SINGLETONJOB_SHUTDOWN_TIMEOUT", id="last-word"),
        pytest.param("lock_expiry", "SINGLETONJOB_LOCK_EXPIRY", id="lower-case-name"),
    ],
)
def test_an_unknown_variable_is_warned_of_with_the_nearest_setting(
    variable: str, nearest: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV + variable, "hunter2")  # a value may be a secret: never shown
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    jobs = build()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"ignored, not a setting of fastapi-singletonjob: {ENV}{variable} (did you mean {nearest}?)"
    ]
    assert jobs.settings.lock_expiry_s == 10.0  # ignored, as the warning says


def test_unknown_variables_are_warned_of_in_one_line_without_their_values(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV + "LOCKEXPIRY", "1")
    monkeypatch.setenv(ENV + "COLOUR", "hunter2")
    monkeypatch.setenv("singletonjob_project", "hunter3")
    monkeypatch.setenv(ENV + "LOCK_EXPIRY", "12")  # known ones are not named
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    assert build().settings.lock_expiry_s == 12.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    named, _, listed = warnings[0].partition("; the variables it reads: ")
    assert named == (
        "ignored, not a setting of fastapi-singletonjob: SINGLETONJOB_COLOUR, "
        "SINGLETONJOB_LOCKEXPIRY (did you mean SINGLETONJOB_LOCK_EXPIRY?), "
        "singletonjob_project (did you mean SINGLETONJOB_PROJECT?)"
    )
    # Nothing is near SINGLETONJOB_COLOUR: the line lists every variable read.
    assert listed.split(", ") == [ENV + name.upper() for name in ENV_SETTINGS]
    assert "hunter" not in warnings[0]


def test_known_variables_draw_no_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for setting in SETTINGS:
        monkeypatch.setenv(ENV + setting.arg.upper(), setting.env_value)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    build(**{setting.arg: None for setting in SETTINGS})
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_env_settings_are_the_settings_of_settings_build() -> None:
    arguments = set(inspect.signature(Settings.build).parameters) - {"has_client", "env", "flags"}
    assert set(ENV_SETTINGS) == arguments


@pytest.mark.parametrize("name", ["myapp", "memory", "billing.prod"])
def test_a_project_name_given_as_the_first_argument_is_told_to_be_project(name: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        SingletonJobs(name)
    assert caught.value.field == "redis_url"
    assert str(caught.value) == (
        f"redis_url={name!r} is not a URL: the first argument of SingletonJobs is the Redis "
        f"URL; to name the project pass SingletonJobs(project={name!r}), with the Redis as "
        "redis_url='redis://localhost:6379/0' (the default), or 'memory://' for one process only"
    )


def test_a_first_argument_that_is_no_name_gets_the_url_forms() -> None:
    with pytest.raises(ConfigurationError, match=r"'localhost:6379' is not supported; use redis:"):
        SingletonJobs("localhost:6379", project="p")


def test_invalid_names_are_told_what_they_name() -> None:
    with pytest.raises(ConfigurationError) as project:
        build(project="my app")
    assert str(project.value).startswith("project='my app' is not a valid project name; use ")
    assert str(project.value).endswith("e.g. project='myapp'")
    with pytest.raises(ConfigurationError) as job:
        build().interval("my job", 1)
    assert str(job.value).startswith("name='my job' is not a valid job name; use ")
    assert str(job.value).endswith("e.g. 'price-tick'")


def test_missing_project_says_how_to_set_it() -> None:
    with pytest.raises(ConfigurationError) as caught:
        SingletonJobs("memory://")
    message = str(caught.value)
    assert "project" in message
    assert "SINGLETONJOB_PROJECT" in message
    assert caught.value.field == "project"
    assert caught.value.job is None


# -- settings that must be rejected when SingletonJobs is built ---------------------------------


@dataclass(frozen=True)
class BadSettings:
    field: str
    fragments: tuple[str, ...]
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _bad_durations() -> Iterator[Any]:
    values: list[tuple[str, object]] = [
        ("zero", 0),
        ("zero-timedelta", timedelta(0)),
        ("negative", -1),
        ("negative-timedelta", timedelta(seconds=-1)),
        ("nan", math.nan),
        ("inf", math.inf),
        ("-inf", -math.inf),
        ("bool", True),
        ("str", "3"),
    ]
    for arg in ("heartbeat_interval", "lock_expiry", "max_backoff", "shutdown_timeout"):
        for label, value in values:
            if arg == "shutdown_timeout" and label.startswith("zero"):
                continue  # allowed: cancel runs in flight at once
            yield pytest.param(
                BadSettings(arg, (f"{arg}={value!r}",), kwargs={arg: value}),
                id=f"{arg}-{label}",
            )


BAD_SETTINGS = [
    *[
        pytest.param(BadSettings("project", (f"project={v!r}",), {"project": v}), id=label)
        for label, v in [
            ("project-empty", ""),
            ("project-space", "my app"),
            ("project-brace", "a{b}"),
            ("project-colon", "a:b"),
            ("project-leading-dash", "-p"),
            ("project-too-long", "p" * 101),
            ("project-not-str", 42),
        ]
    ],
    *[
        pytest.param(BadSettings("node_id", ("node_id=",), {"node_id": v}), id=label)
        for label, v in [
            ("node_id-newline", "node\n1"),
            ("node_id-too-long", "n" * 201),
            ("node_id-not-str", 42),
        ]
    ],
    *_bad_durations(),
    pytest.param(
        BadSettings(
            "heartbeat_interval", ("heartbeat_interval=0.0005",), {"heartbeat_interval": 0.0005}
        ),
        id="heartbeat_interval-sub-millisecond",
    ),
    pytest.param(
        BadSettings(
            "lock_expiry",
            ("lock_expiry=10s", "heartbeat_interval=10s"),
            {"heartbeat_interval": 10, "lock_expiry": 10},
        ),
        id="lock_expiry-equals-heartbeat",
    ),
    pytest.param(
        BadSettings(
            "lock_expiry",
            ("lock_expiry=4s", "heartbeat_interval=5s"),
            {"heartbeat_interval": 5, "lock_expiry": 4},
        ),
        id="lock_expiry-below-heartbeat",
    ),
    pytest.param(
        BadSettings(
            "max_backoff",
            ("max_backoff=2s", "heartbeat_interval=3s"),
            {"heartbeat_interval": 3, "max_backoff": 2},
        ),
        id="max_backoff-below-heartbeat",
    ),
    pytest.param(
        BadSettings("lock_expiry", ("SINGLETONJOB_LOCK_EXPIRY='abc'",), env={"LOCK_EXPIRY": "abc"}),
        id="env-lock_expiry-not-a-number",
    ),
    pytest.param(
        BadSettings(
            "heartbeat_interval", ("heartbeat_interval=-1.0",), env={"HEARTBEAT_INTERVAL": "-1"}
        ),
        id="env-heartbeat-negative",
    ),
    pytest.param(
        BadSettings("max_backoff", ("max_backoff=nan",), env={"MAX_BACKOFF": "nan"}),
        id="env-max_backoff-nan",
    ),
    pytest.param(
        BadSettings(
            "lock_expiry",
            ("lock_expiry=2s", "heartbeat_interval=3s"),
            env={"LOCK_EXPIRY": "2"},
        ),
        id="env-lock_expiry-below-default-heartbeat",
    ),
    pytest.param(
        BadSettings("project", ("project='my app'",), {"project": None}, {"PROJECT": "my app"}),
        id="env-project-malformed",
    ),
    pytest.param(
        BadSettings("redis_url", ("'http://h/'",), {"redis_url": "http://h/"}),
        id="redis_url-http",
    ),
    pytest.param(
        BadSettings("redis_url", ("redis_url=''",), {"redis_url": ""}),
        id="redis_url-empty",
    ),
    pytest.param(
        BadSettings("redis_url", ("'ftp://h/'",), {"redis_url": None}, {"REDIS_URL": "ftp://h/"}),
        id="env-redis_url-ftp",
    ),
    pytest.param(
        BadSettings(
            "redis_url",
            ("either redis_url= or redis=",),
            {"redis_url": "redis://h/0", "redis": redis.asyncio.Redis()},
        ),
        id="redis_url-and-redis",
    ),
    pytest.param(
        BadSettings("redis", ("redis=object",), {"redis_url": None, "redis": object()}),
        id="redis-not-a-client",
    ),
    pytest.param(
        BadSettings(
            "redis", ("redis=Redis", "redis.asyncio"), {"redis_url": None, "redis": redis.Redis()}
        ),
        id="redis-sync-client",
    ),
]


@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_invalid_setting_fails_at_construction(
    case: BadSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in case.env.items():
        monkeypatch.setenv(ENV + name, value)
    with pytest.raises(ConfigurationError) as caught:
        build(**case.kwargs)
    error = caught.value
    assert isinstance(error, ValueError)
    assert isinstance(error, SingletonJobError)
    assert (error.field, error.job) == (case.field, None)
    for fragment in case.fragments:
        assert fragment in str(error)


# -- registrations that must be rejected at definition -------------------------------------------


@dataclass(frozen=True)
class BadJob:
    field: str
    job: str | None
    fragments: tuple[str, ...]
    define: Callable[[SingletonJobs], object]


def _register(kind: str, name: object) -> Callable[[SingletonJobs], object]:
    def define(jobs: SingletonJobs) -> object:
        if kind == "interval":
            return jobs.interval(bad(name), 1)(noop)
        if kind == "fixed_rate":
            return jobs.fixed_rate(bad(name), 1)(noop)
        if kind == "cron":
            return jobs.cron(bad(name), "* * * * *")(noop)
        return jobs.schedule(bad(name), EveryMinute())(noop)

    return define


def _call(method: str, *args: Any, **kwargs: Any) -> Callable[[SingletonJobs], object]:
    """``jobs.<method>(*args, **kwargs)``, for table rows built in a loop."""

    def define(jobs: SingletonJobs) -> object:
        return getattr(jobs, method)(*args, **kwargs)

    return define


def _register_twice(jobs: SingletonJobs) -> object:
    jobs.interval("x", 1)(noop)
    return jobs.cron("x", "* * * * *")


def _decorate_twice(jobs: SingletonJobs) -> object:
    decorator = jobs.interval("x", 1)
    decorator(noop)
    return decorator(async_noop)


def _bad_names() -> Iterator[Any]:
    names: list[tuple[str, object]] = [
        ("empty", ""),
        ("space", "my job"),
        ("brace", "a{b}"),
        ("colon", "a:b"),
        ("slash", "a/b"),
        ("too-long", "j" * 101),
        ("not-str", 42),
    ]
    for kind in ("interval", "fixed_rate", "cron", "schedule"):
        for label, name in names:
            yield pytest.param(
                BadJob("name", None, (f"name={name!r}",), _register(kind, name)),
                id=f"{kind}-name-{label}",
            )


def _bad_every() -> Iterator[Any]:
    values: list[tuple[str, object]] = [
        ("zero", 0),
        ("negative", -1),
        ("nan", math.nan),
        ("inf", math.inf),
        ("bool", True),
        ("str", "1"),
        ("sub-millisecond", 0.0005),
        ("sub-millisecond-timedelta", timedelta(microseconds=500)),
    ]
    for label, value in values:
        yield pytest.param(
            BadJob("every", "x", (f"every={value!r}",), _call("interval", "x", value)),
            id=f"interval-every-{label}",
        )
        yield pytest.param(
            BadJob("every", "x", (f"every={value!r}",), _call("fixed_rate", "x", value)),
            id=f"fixed_rate-every-{label}",
        )


BAD_JOBS = [
    *_bad_names(),
    pytest.param(
        BadJob("name", "x", ("already registered",), _register_twice), id="duplicate-name"
    ),
    pytest.param(
        BadJob("name", "x", ("already registered",), _decorate_twice),
        id="same-decorator-applied-twice",
    ),
    *_bad_every(),
    pytest.param(
        BadJob(
            "offset", "x", ("offset=10s", "every=10s"), lambda j: j.fixed_rate("x", 10, offset=10)
        ),
        id="offset-equals-every",
    ),
    pytest.param(
        BadJob(
            "offset", "x", ("offset=15s", "every=10s"), lambda j: j.fixed_rate("x", 10, offset=15)
        ),
        id="offset-above-every",
    ),
    pytest.param(
        BadJob("offset", "x", ("offset=-1",), lambda j: j.fixed_rate("x", 10, offset=-1)),
        id="offset-negative",
    ),
    *[
        pytest.param(
            BadJob("timeout", "x", (f"timeout={v!r}",), _call("interval", "x", 1, timeout=v)),
            id=f"timeout-{label}",
        )
        for label, v in [("negative", -1), ("zero", 0), ("nan", math.nan), ("str", "5")]
    ],
    pytest.param(
        BadJob(
            "lock_expiry",
            "x",
            ("lock_expiry=3s", "heartbeat_interval=3s"),
            lambda j: j.interval("x", 1, lock_expiry=3),
        ),
        id="job-lock_expiry-equals-heartbeat",
    ),
    pytest.param(
        BadJob(
            "lock_expiry",
            "x",
            ("lock_expiry=2s", "heartbeat_interval=3s"),
            lambda j: j.cron("x", "* * * * *", lock_expiry=timedelta(seconds=2)),
        ),
        id="job-lock_expiry-below-heartbeat",
    ),
    pytest.param(
        BadJob(
            "lock_expiry",
            "x",
            ("lock_expiry=nan",),
            lambda j: j.interval("x", 1, lock_expiry=math.nan),
        ),
        id="job-lock_expiry-nan",
    ),
    pytest.param(
        BadJob(
            "misfire_grace",
            "x",
            ("misfire_grace=-1",),
            lambda j: j.cron("x", "* * * * *", misfire_grace=-1),
        ),
        id="misfire_grace-negative",
    ),
    *[
        pytest.param(
            BadJob("expression", "x", (f"expression={e!r}",), _call("cron", "x", e)),
            id=f"cron-{label}",
        )
        for label, e in [
            ("minute-61", "61 * * * *"),
            ("four-fields", "* * * *"),
            ("seven-fields", "0 0 * * * 0 2030"),
            ("never-fires", "0 0 31 2 *"),
            ("garbage", "every day"),
            ("not-str", 5),
        ]
    ],
    pytest.param(
        BadJob(
            "timezone",
            "x",
            ("timezone='Mars/Olympus'",),
            lambda j: j.cron("x", "* * * * *", timezone="Mars/Olympus"),
        ),
        id="cron-unknown-timezone",
    ),
    pytest.param(
        BadJob(
            "timezone", "x", ("timezone=5",), lambda j: j.cron("x", "* * * * *", timezone=bad(5))
        ),
        id="cron-timezone-not-str",
    ),
    # Fields croniter draws a value for: replicas would disagree (issue 27, item 6).
    *[
        pytest.param(
            BadJob(
                "expression",
                "daily",
                (f"expression={expression!r}", f"{drawn!r} in its {field} field", why, fix),
                _call("cron", "daily", expression),
            ),
            id=f"cron-{expression}",
        )
        for expression, drawn, field, why, fix in [
            ("R 3 * * *", "R", "minute", "random", "expression='0 3 * * *'"),
            ("0 r(2-5) * * *", "r(2-5)", "hour", "random", "expression='0 2 * * *'"),
            ("*/5 * * * * R", "R", "second", "random", "expression='*/5 * * * * 0'"),
            ("H 3 * * *", "H", "minute", "hashed", "expression='0 3 * * *'"),
            ("H(0-29)/10 * * * *", "H(0-29)/10", "minute", "hashed", "'0-29/10 * * * *'"),
        ]
    ],
    pytest.param(
        BadJob(
            "on_leadership_lost",
            "x",
            ("on_leadership_lost='abort'", "'finish'", "'cancel'"),
            lambda j: j.interval("x", 1, on_leadership_lost=bad("abort"))(noop),
        ),
        id="on_leadership_lost-abort",
    ),
    pytest.param(
        BadJob(
            "enabled",
            "x",
            ("enabled='yes'",),
            lambda j: j.interval("x", 1, enabled=bad("yes"))(noop),
        ),
        id="enabled-not-bool",
    ),
    pytest.param(
        BadJob("func", "x", ("42", "not callable"), lambda j: j.interval("x", 1)(bad(42))),
        id="decorated-not-callable",
    ),
    # A generator function would never run its body, each run a success (issue 29, item 3).
    *[
        pytest.param(
            BadJob("func", "x", (f"func={shown}", f"is {kind}", "never run", "Depends"), define),
            id=label,
        )
        for label, shown, kind, define in [
            (
                "generator-function",
                "generator_job",
                "a generator function (a `def` with `yield`)",
                lambda j: j.interval("x", 1)(generator_job),
            ),
            (
                "async-generator-function",
                "async_generator_job",
                "an async generator function (an `async def` with `yield`)",
                lambda j: j.cron("x", "@daily")(async_generator_job),
            ),
            (
                "generator-through-partial",
                "functools.partial(<function generator_job",
                "a generator function",
                lambda j: j.fixed_rate("x", 1)(functools.partial(generator_job, retries=1)),
            ),
            (
                "generator-callable-object",
                "<test_config.GeneratorCallable object",
                "a generator function",
                lambda j: j.schedule("x", EveryMinute())(GeneratorCallable()),
            ),
        ]
    ],
    pytest.param(
        BadJob(
            "value",
            "x",
            ("'value'", "needs_value", "JobContext"),
            lambda j: j.interval("x", 1)(needs_value),
        ),
        id="unresolvable-parameter",
    ),
    pytest.param(
        BadJob(
            "limit",
            "x",
            ("'limit'", "needs_keyword"),
            lambda j: j.cron("x", "@daily")(needs_keyword),
        ),
        id="unresolvable-keyword-only-parameter",
    ),
    pytest.param(
        BadJob("schedule", "x", ("next_fire",), lambda j: j.schedule("x", bad(object()))),
        id="schedule-without-next_fire",
    ),
    pytest.param(
        BadJob(
            "schedule", "x", ("next_fire",), lambda j: j.schedule("x", bad(NextFireNotCallable()))
        ),
        id="schedule-next_fire-not-callable",
    ),
]


@pytest.mark.parametrize("case", BAD_JOBS)
def test_invalid_job_fails_at_definition(case: BadJob) -> None:
    jobs = build()
    with pytest.raises(ConfigurationError) as caught:
        case.define(jobs)
    error = caught.value
    assert isinstance(error, ValueError)
    assert (error.field, error.job) == (case.field, case.job)
    message = str(error)
    if case.job is not None:
        assert message.startswith(f"job {case.job!r}: ")
    for fragment in case.fragments:
        assert fragment in message


def test_rejected_registration_leaves_nothing_behind() -> None:
    jobs = build()
    with pytest.raises(ConfigurationError):
        jobs.interval("x", 0)
    with pytest.raises(ConfigurationError):
        jobs.interval("x", 1, on_leadership_lost=bad("abort"))(noop)
    with pytest.raises(ConfigurationError):
        jobs.interval("x", 1)(needs_value)
    assert jobs.jobs == {}
    jobs.interval("x", 1)(noop)  # the name is still free
    assert list(jobs.jobs) == ["x"]


# -- warnings -------------------------------------------------------------------------------------


def _lease_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and "3x" in r.getMessage()
    ]


@pytest.mark.parametrize(
    ("heartbeat", "expiry", "warns"),
    [
        pytest.param(3, 8.9, True, id="below-3x"),
        pytest.param(1, 2.5, True, id="2.5x"),
        pytest.param(3, 9, False, id="exactly-3x"),
        pytest.param(3, 10, False, id="defaults"),
        pytest.param(0.1, 0.3, False, id="exactly-3x-float-rounding"),
        pytest.param(
            timedelta(milliseconds=100),
            timedelta(milliseconds=300),
            False,
            id="exactly-3x-timedelta",
        ),
    ],
)
def test_short_lock_expiry_is_logged_as_a_warning(
    heartbeat: Any, expiry: Any, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    build(heartbeat_interval=heartbeat, lock_expiry=expiry)
    records = _lease_warnings(caplog)
    assert len(records) == (1 if warns else 0), [r.getMessage() for r in records]
    if warns:
        assert f"lock_expiry={float(expiry):g}s" in records[0].getMessage()


@pytest.mark.parametrize(
    ("expiry", "warns"),
    [pytest.param(7, True, id="below-3x"), pytest.param(9, False, id="exactly-3x")],
)
def test_short_per_job_lock_expiry_is_logged_with_the_job(
    expiry: float, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = build(heartbeat_interval=3, lock_expiry=30)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    jobs.interval("x", 1, lock_expiry=expiry)(noop)
    records = _lease_warnings(caplog)
    assert len(records) == (1 if warns else 0)
    if warns:
        assert records[0].getMessage().startswith("job 'x': lock_expiry=7s")


@pytest.mark.parametrize(
    ("expression", "warns"),
    [
        pytest.param("0 */5 * * * *", True, id="quartz-every-5-minutes"),
        pytest.param("*/5 * * * * 0", False, id="seconds-last"),
        pytest.param("0 */5 * * *", False, id="five-fields"),
    ],
)
def test_a_cron_written_seconds_first_is_warned_of_with_the_job(
    expression: str, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = build()
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    jobs.cron("report", expression)(noop)
    records = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(records) == (1 if warns else 0), [r.getMessage() for r in records]
    if warns:
        message = records[0].getMessage()
        assert message.startswith(f"job 'report': expression={expression!r} has 6 fields")
        assert "write expression='*/5 * * * *'" in message
    assert list(jobs.jobs) == ["report"]  # a warning, not a refusal


# -- item 12 of issue 11: settings that cannot work ----------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(0, id="zero"),
        pytest.param(0.0, id="zero-float"),
        pytest.param(timedelta(0), id="zero-timedelta"),
        pytest.param(-1, id="negative"),
        pytest.param(timedelta(seconds=-1), id="negative-timedelta"),
        pytest.param(-math.inf, id="-inf"),
        pytest.param(0.001, id="one-millisecond"),
        pytest.param(timedelta(milliseconds=49), id="below-the-minimum"),
    ],
)
@pytest.mark.parametrize("kind", ["cron", "schedule"])
def test_item12_misfire_grace_zero_refused(kind: str, value: Any) -> None:
    # A run starts a few milliseconds after its instant, so a grace of zero dropped every
    # instant as late: the job was accepted and never ran.
    jobs = build()
    with pytest.raises(ConfigurationError) as caught:
        if kind == "cron":
            jobs.cron("x", "* * * * * *", misfire_grace=value)
        else:
            jobs.schedule("x", EveryMinute(), misfire_grace=value)
    error = caught.value
    assert (error.field, error.job) == ("misfire_grace", "x")
    message = str(error)
    assert message.startswith("job 'x': ")
    assert f"misfire_grace={value!r}" in message
    assert "at least misfire_grace=0.05" in message and "leave it unset" in message
    assert jobs.jobs == {}


@pytest.mark.parametrize("value", [0.05, timedelta(milliseconds=50), 1])
def test_item12_misfire_grace_at_the_minimum_is_accepted(value: Any) -> None:
    jobs = build()
    jobs.cron("x", "* * * * * *", misfire_grace=value)(noop)
    assert jobs.jobs["x"].misfire_grace_s == pytest.approx(to_seconds_of(value))


def to_seconds_of(value: Any) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


UNWORKABLE_LEASES = [
    pytest.param(1, 2, id="exactly-2x"),
    pytest.param(5, 10, id="heartbeat-5s-with-the-default-expiry"),
    pytest.param(3, 6, id="2x-of-the-default-heartbeat"),
    pytest.param(0.1, 0.2, id="2x-sub-second"),
    pytest.param(0.002, 0.004, id="lease-shorter-than-its-margin-never-leads"),
    pytest.param(0.01, 0.025, id="2.5x-but-the-5ms-margin-eats-it"),
]


@pytest.mark.parametrize(("heartbeat", "expiry"), UNWORKABLE_LEASES)
def test_item12_lock_expiry_that_cannot_survive_a_failed_renewal_refused(
    heartbeat: float, expiry: float
) -> None:
    # Barely above the heartbeat used to pass: the lease then ended on the first failed (or
    # slightly late) renewal, and leadership flapped, or, below the margin, never started.
    with pytest.raises(ConfigurationError) as caught:
        build(heartbeat_interval=heartbeat, lock_expiry=expiry)
    error = caught.value
    assert (error.field, error.job) == ("lock_expiry", None)
    message = str(error)
    minimum = min_lock_expiry_s(heartbeat)
    assert f"lock_expiry={expiry:g}s" in message and f"heartbeat_interval={heartbeat:g}s" in message
    assert f"raise lock_expiry to at least {minimum:g}s" in message
    build(heartbeat_interval=heartbeat, lock_expiry=minimum)  # the fix it gives works
    if "lower heartbeat_interval" in message:
        lowered = float(message.split("heartbeat_interval to at most ")[1].split("s")[0])
        build(heartbeat_interval=lowered, lock_expiry=expiry)  # and so does the other fix


@pytest.mark.parametrize(("heartbeat", "expiry"), UNWORKABLE_LEASES)
def test_item12_per_job_lock_expiry_that_cannot_survive_a_failed_renewal_refused(
    heartbeat: float, expiry: float
) -> None:
    jobs = build(heartbeat_interval=heartbeat, lock_expiry=1000 * heartbeat)
    with pytest.raises(ConfigurationError) as caught:
        jobs.fixed_rate("x", 1, lock_expiry=expiry)
    error = caught.value
    assert (error.field, error.job) == ("lock_expiry", "x")
    assert str(error).startswith(f"job 'x': lock_expiry={expiry:g}s is too short")
    assert jobs.jobs == {}


def test_item12_lock_expiry_from_the_environment_is_checked_against_the_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV + "HEARTBEAT_INTERVAL", "5")  # with the default lock expiry, 10 s
    with pytest.raises(ConfigurationError, match=r"at least 10\.617s"):
        build()


@pytest.mark.parametrize("heartbeat", [0.001, 0.002, 0.01, 0.05, 0.1, 0.2, 1, 3, 10, 3600])
def test_item12_min_lock_expiry_leaves_two_heartbeats_and_a_round_trip(heartbeat: float) -> None:
    """The rule, against the election's own deadline: what is left of the lease after the
    safety margin covers the failed renewal, the next one and a tenth of a heartbeat."""
    minimum = min_lock_expiry_s(heartbeat)
    assert lease_deadline(0.0, minimum) >= 2.1 * heartbeat
    assert lease_deadline(0.0, minimum - 0.001) < 2.1 * heartbeat  # the smallest, to the ms
    assert minimum >= 2 * heartbeat


@pytest.mark.parametrize(
    ("heartbeat", "expiry"),
    [
        pytest.param(3, 10, id="defaults"),
        pytest.param(0.1, 0.5, id="tests-and-chaos"),
        pytest.param(0.05, 0.15, id="lifespan-failures-3x"),
        pytest.param(0.02, 0.1, id="lifespan-fast"),
        pytest.param(0.2, 1, id="quick-demo"),
        pytest.param(0.5, 2, id="sizing-sub-second-preset"),
        pytest.param(1, 4, id="sizing-faster-failover-preset"),
        pytest.param(10, 40, id="sizing-large-fleet-preset"),
        pytest.param(1, 2.2, id="just-above-the-rule"),
    ],
)
def test_item12_configurations_in_use_stay_accepted(heartbeat: float, expiry: float) -> None:
    jobs = build(heartbeat_interval=heartbeat, lock_expiry=expiry)
    jobs.interval("x", 1, lock_expiry=expiry)(noop)
    assert jobs.settings.lock_expiry_s == expiry


# -- secrets --------------------------------------------------------------------------------------

URLS_WITH_PASSWORD = [
    pytest.param("redis://user:hunter2@host:6379/0", id="user-and-password"),
    pytest.param("redis://:hunter2@host:6379/0", id="password-only"),
    pytest.param("rediss://default:hunter2@host:6379/0", id="tls"),
]


@pytest.mark.parametrize("url", URLS_WITH_PASSWORD)
def test_password_stays_out_of_reprs(url: str) -> None:
    jobs = build(redis_url=url)
    assert jobs.settings.redis_url == url  # still there to connect with
    for text in (repr(jobs.settings), str(jobs.settings), repr(jobs)):
        assert "hunter2" not in text
    assert "host:6379" in repr(jobs.settings)


def test_password_from_env_stays_out_of_reprs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV + "REDIS_URL", "redis://user:hunter2@host:6379/0")
    jobs = build(redis_url=None)
    assert jobs.settings.redis_url == "redis://user:hunter2@host:6379/0"
    assert "hunter2" not in repr(jobs.settings)


def test_password_in_query_stays_out_of_reprs() -> None:
    jobs = build(redis_url="redis://host:6379/0?password=hunter2")
    assert "hunter2" not in repr(jobs.settings)


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("http://user:hunter2@h/", id="user-and-password"),
        pytest.param("https://:hunter2@h:8080/", id="password-only"),
    ],
)
def test_password_stays_out_of_unsupported_scheme_error(url: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        build(redis_url=url)
    assert caught.value.field == "redis_url"
    assert "hunter2" not in str(caught.value)
    assert "hunter2" not in repr(caught.value)
    assert "://***@h" in str(caught.value)


# -- node id --------------------------------------------------------------------------------------


def test_default_node_id_has_pid_and_is_unique_per_instance() -> None:
    first, second = build().node_id, build().node_id
    assert f"-{os.getpid()}-" in first
    assert f"-{os.getpid()}-" in second
    assert first != second


def test_default_node_id_starts_with_pod_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "web-7f9c")
    monkeypatch.setenv("HOSTNAME", "ignored-host")
    assert build().node_id.startswith(f"web-7f9c-{os.getpid()}-")


def test_default_node_id_falls_back_to_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("HOSTNAME", raising=False)
    assert build().node_id.startswith(f"{socket.gethostname() or 'node'}-{os.getpid()}-")


# -- registration ---------------------------------------------------------------------------------


def add_one(value: int = 1) -> int:
    """A job with a default parameter and a result, to check the decorator returns it as is."""
    return value + 1


@pytest.mark.parametrize("kind", ["interval", "fixed_rate", "cron", "schedule"])
def test_decorator_returns_the_function_unchanged(kind: str) -> None:
    jobs = build()
    decorators: dict[str, Callable[[], Callable[[Callable[..., int]], Callable[..., int]]]] = {
        "interval": lambda: jobs.interval("j", 1),
        "fixed_rate": lambda: jobs.fixed_rate("j", 1),
        "cron": lambda: jobs.cron("j", "* * * * *"),
        "schedule": lambda: jobs.schedule("j", EveryMinute()),
    }
    decorated = decorators[kind]()(add_one)
    assert decorated is add_one
    assert decorated(41) == 42
    assert jobs.jobs["j"].func is add_one
    assert jobs.jobs["j"].kind == ("custom" if kind == "schedule" else kind)


def test_jobs_lists_registered_specs() -> None:
    jobs = build()
    custom = EveryMinute()
    jobs.interval("tick", timedelta(minutes=1), timeout=timedelta(seconds=30))(noop)
    jobs.fixed_rate("rate", 10, offset=2.5, lock_expiry=20, on_leadership_lost="cancel")(async_noop)
    jobs.cron("nightly", "0 3 * * *", timezone="Europe/Berlin", misfire_grace=60)(with_context)
    jobs.schedule("custom", custom, enabled=False)(noop)

    specs = jobs.jobs
    assert list(specs) == ["tick", "rate", "nightly", "custom"]
    tick, rate, nightly, other = specs.values()
    assert (tick.schedule, tick.timeout_s, tick.enabled) == (Interval(60.0), 30.0, True)
    assert (rate.schedule, rate.lock_expiry_s, rate.on_leadership_lost) == (
        FixedRate(10.0, 2.5),
        20.0,
        "cancel",
    )
    assert rate.is_async and not tick.is_async
    assert (nightly.schedule, nightly.misfire_grace_s) == (Cron("0 3 * * *", "Europe/Berlin"), 60.0)
    assert (other.schedule, other.kind) == (custom, "custom")
    assert "custom" in repr(jobs)


def test_disabled_job_is_registered_but_marked_disabled() -> None:
    jobs = build()
    jobs.interval("off", 1, enabled=False)(noop)
    jobs.interval("on", 1)(noop)
    assert {name: spec.enabled for name, spec in jobs.jobs.items()} == {"off": False, "on": True}


def test_jobs_property_is_a_copy() -> None:
    jobs = build()
    jobs.interval("x", 1)(noop)
    jobs.jobs.clear()
    assert list(jobs.jobs) == ["x"]


def test_defaults_of_a_registered_job() -> None:
    jobs = build()
    jobs.interval("x", 1)(noop)
    spec = jobs.jobs["x"]
    assert (spec.enabled, spec.timeout_s, spec.on_leadership_lost) == (True, None, "finish")
    assert (spec.lock_expiry_s, spec.misfire_grace_s) == (None, None)


# -- public surface -------------------------------------------------------------------------------

PUBLIC_NAMES = [
    "Checkpoint",
    "ClusterJob",
    "ClusterNode",
    "ClusterStatus",
    "ConfigurationError",
    "Cron",
    "DropReason",
    "FixedRate",
    "HealthStatus",
    "HistoryEntry",
    "Interval",
    "JobContext",
    "JobHealth",
    "JobHistory",
    "JobNotFound",
    "JobReport",
    "JobStatus",
    "JobsHealth",
    "LastRun",
    "LeadershipLost",
    "NodeStatus",
    "Occurrence",
    "Outcome",
    "OverdueEvent",
    "Schedule",
    "ScheduleError",
    "SingletonJobError",
    "SingletonJobs",
    "StoreStatus",
    "UsageError",
    "__version__",
    "job_context",
]


def test_all_is_pinned() -> None:
    assert fastapi_singletonjob.__all__ == PUBLIC_NAMES


def test_all_is_the_sorted_list_of_public_names() -> None:
    public = {
        name
        for name, value in vars(fastapi_singletonjob).items()
        if not name.startswith("_") and not isinstance(value, ModuleType)
    }
    public.add("__version__")
    assert fastapi_singletonjob.__all__ == sorted(public)
    for name in fastapi_singletonjob.__all__:
        assert hasattr(fastapi_singletonjob, name), name


# -- issue 15: a configured node id is never replaced; environment errors name the variable ------


@pytest.mark.parametrize(
    "node_id",
    [pytest.param("", id="empty"), pytest.param("   ", id="blank"), pytest.param(0, id="zero")],
)
def test_an_explicit_empty_node_id_is_refused_not_replaced(node_id: object) -> None:
    with pytest.raises(ConfigurationError) as caught:
        build(node_id=bad(node_id))
    error = caught.value
    assert (error.field, error.job) == ("node_id", None)
    message = str(error)
    assert message.startswith(f"node_id={node_id!r} ")
    assert "node_id='web-1'" in message  # the fix: a name...
    assert "leave node_id unset" in message  # ...or the default


def test_an_empty_node_id_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """As documented for every variable: ``SINGLETONJOB_NODE_ID=`` in a compose file means
    "not set", unlike an argument, which the code passed on purpose."""
    monkeypatch.setenv(ENV + "NODE_ID", "")
    jobs = build()
    assert f"-{os.getpid()}-" in jobs.node_id
    assert jobs.settings.node_id_generated_in == os.getpid()


@dataclass(frozen=True)
class EnvError:
    env: Mapping[str, str]
    field: str
    prefix: str
    """How the message must begin: the argument, then the variable it was read from."""
    fragments: tuple[str, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


ENV_ERRORS = [
    pytest.param(
        EnvError(
            {"HEARTBEAT_INTERVAL": "3s"},
            "heartbeat_interval",
            "heartbeat_interval (from SINGLETONJOB_HEARTBEAT_INTERVAL='3s'): ",
            ("not a number of seconds", "e.g. '3' or '0.5'"),
        ),
        id="heartbeat-not-a-number",
    ),
    pytest.param(
        EnvError(
            {"HEARTBEAT_INTERVAL": "-1"},
            "heartbeat_interval",
            "heartbeat_interval (from SINGLETONJOB_HEARTBEAT_INTERVAL='-1'): ",
            ("heartbeat_interval=-1.0 must be",),
        ),
        id="heartbeat-negative",
    ),
    pytest.param(
        EnvError(
            {"HEARTBEAT_INTERVAL": "5", "LOCK_EXPIRY": "6"},
            "lock_expiry",
            "lock_expiry (from SINGLETONJOB_LOCK_EXPIRY='6'): ",
            ("lock_expiry=6s is too short", "heartbeat_interval came from "),
        ),
        id="lock_expiry-too-short",
    ),
    pytest.param(
        EnvError(
            {"MAX_BACKOFF": "1"},
            "max_backoff",
            "max_backoff (from SINGLETONJOB_MAX_BACKOFF='1'): ",
            ("max_backoff=1s is below heartbeat_interval=3s",),
        ),
        id="max_backoff-below-heartbeat",
    ),
    pytest.param(
        EnvError(
            {"SHUTDOWN_TIMEOUT": "inf"},
            "shutdown_timeout",
            "shutdown_timeout (from SINGLETONJOB_SHUTDOWN_TIMEOUT='inf'): ",
        ),
        id="shutdown_timeout-inf",
    ),
    pytest.param(
        EnvError({"PRECISION": "1"}, "precision", "precision (from SINGLETONJOB_PRECISION='1'): "),
        id="precision-too-long",
    ),
    pytest.param(
        EnvError(
            {"PROJECT": "my app"},
            "project",
            "project (from SINGLETONJOB_PROJECT='my app'): ",
            ("project='my app' is not a valid project name",),
            {"project": None},
        ),
        id="project-malformed",
    ),
    pytest.param(
        EnvError(
            {"NODE_ID": "web\n1"},
            "node_id",
            "node_id (from SINGLETONJOB_NODE_ID='web\\n1'): ",
        ),
        id="node_id-not-printable",
    ),
    pytest.param(
        EnvError(
            {"REDIS_URL": "ftp://user:hunter2@h/"},
            "redis_url",
            "redis_url (from SINGLETONJOB_REDIS_URL): ",  # no value: it may hold a password
            ("redis_url='ftp://***@h/' is not supported",),
            {"redis_url": None},
        ),
        id="redis_url-unsupported",
    ),
]


@pytest.mark.parametrize("case", ENV_ERRORS)
def test_errors_for_environment_values_name_the_argument_and_the_variable(
    case: EnvError, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in case.env.items():
        monkeypatch.setenv(ENV + name, value)
    with pytest.raises(ConfigurationError) as caught:
        build(**case.kwargs)
    error = caught.value
    assert (error.field, error.job) == (case.field, None)
    message = str(error)
    assert message.startswith(case.prefix), message
    for fragment in case.fragments:
        assert fragment in message, message
    assert "hunter2" not in message
    assert "hunter2" not in repr(error)


def test_an_error_about_an_argument_names_the_variable_of_the_other_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV + "HEARTBEAT_INTERVAL", "5")
    with pytest.raises(ConfigurationError) as caught:
        build(lock_expiry=10)  # the argument is fine alone; the heartbeat makes it too short
    message = str(caught.value)
    assert caught.value.field == "lock_expiry"
    assert message.startswith("lock_expiry=10s is too short for heartbeat_interval=5s")
    assert message.endswith("; heartbeat_interval came from SINGLETONJOB_HEARTBEAT_INTERVAL='5'"), (
        message
    )


def test_errors_for_arguments_do_not_mention_the_environment() -> None:
    with pytest.raises(ConfigurationError) as caught:
        build(heartbeat_interval=-1)
    assert str(caught.value).startswith("heartbeat_interval=-1 must be")
    assert "SINGLETONJOB_" not in str(caught.value)


# -- redis_url query parameters (issue 27, item 7) -------------------------------------------


@pytest.mark.parametrize(
    ("url", "fragments"),
    [
        (
            "redis://127.0.0.1:6379/0?socket_timout=1",
            ("socket_timout=", "Connection does not take", "did you mean socket_timeout="),
        ),
        (
            "unix:///run/redis.sock?db=1&socket_conect_timeout=1",
            ("socket_conect_timeout=", "did you mean socket_connect_timeout="),
        ),
        (
            "redis://127.0.0.1:6379/0?ssl_cert_reqs=none",
            ("TLS parameter ssl_cert_reqs=", "use rediss://"),
        ),
        (
            "redis+cluster://10.0.0.1:7000,10.0.0.2:7000/?healthcheck_interval=5",
            ("RedisCluster does not take", "did you mean health_check_interval="),
        ),
        (
            "redis+cluster://10.0.0.1:7000/?ssl_ca_certs=/ca.pem",
            ("TLS parameter ssl_ca_certs=", "use rediss+cluster://"),
        ),
        # A '&' typed unescaped in a password: the rest must not be quoted.
        (
            "redis://127.0.0.1:6379/0?password=s3cr&Tpart=x9",
            ("redis://127.0.0.1:6379/0?password=***&***", "its name is not shown", "%26"),
        ),
        (
            "redis://127.0.0.1:6379/0?db=0&Zq9!wX=1",
            ("its name is not shown", "socket_timeout"),
        ),
    ],
)
def test_an_unknown_url_parameter_fails_when_the_settings_are_built(
    url: str, fragments: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        build(redis_url=url)
    message = str(caught.value)
    assert caught.value.field == "redis_url"
    assert message.startswith("redis_url='")
    for fragment in fragments:
        assert fragment in message, message
    for secret in ("s3cr", "Tpart", "Zq9"):
        assert secret not in message


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0?socket_timeout=1&socket_connect_timeout=2&client_name=web",
        "redis://:pw@127.0.0.1:6379/3?health_check_interval=5&protocol=3&socket_keepalive=true",
        "rediss://127.0.0.1:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem&ssl_password=x",
        "unix:///run/redis.sock?db=2&socket_timeout=1",
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7000/?socket_timeout=1",
        "rediss+cluster://10.0.0.1:7000/?ssl_ca_certs=/ca.pem&ssl_check_hostname=false",
        "redis+sentinel://s1:26379,s2/mymaster/0?sentinel_password=pw",
    ],
)
def test_known_url_parameters_are_accepted(url: str) -> None:
    build(redis_url=url)
