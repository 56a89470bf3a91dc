"""Settings: explicit arguments, then ``SINGLETONJOB_*`` environment variables, then defaults.

Everything is validated here, once, when ``SingletonJobs`` is built;
an error names the field, the bad value and the fix. Durations are accepted as
``datetime.timedelta`` or seconds (``int``/``float``) and normalised to float seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ._exceptions import ConfigurationError

__all__ = ["Duration", "Settings", "check_name", "redact_url", "to_seconds"]

logger = logging.getLogger("fastapi_singletonjob")

Duration = timedelta | float | int
"""A duration: a ``timedelta``, or a number of seconds."""

ENV_PREFIX: Final = "SINGLETONJOB_"
DEFAULT_REDIS_URL: Final = "redis://localhost:6379/0"
MIN_PERIOD_S: Final = 0.001
URL_SCHEMES: Final = ("redis", "rediss", "unix", "memory")

MAX_DURATION_S: Final = 10 * 366 * 86400.0
_SECRET_PARAMS = frozenset({"password", "username", "user"})
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
_NAME_RULE = "1-100 characters: letters, digits, '-', '_' or '.', starting with a letter or digit"


def check_name(value: object, *, field: str, job: str | None = None) -> str:
    """Validate a project or job name: it becomes part of Redis keys and URLs."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigurationError(
            f"{field}={value!r} is not a valid name; use {_NAME_RULE}, e.g. 'price-tick'",
            job=job,
            field=field,
        )
    return value


def to_seconds(
    value: object,
    *,
    field: str,
    job: str | None = None,
    minimum_s: float = 0.0,
    allow_zero: bool = False,
) -> float:
    """Normalise a ``timedelta`` or a number of seconds to float seconds, or raise.

    The value must be finite and positive (or zero when ``allow_zero``), and at least
    ``minimum_s`` when it is not zero.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ConfigurationError(
            f"{field}={value!r} is not a duration; pass seconds as a number or a "
            f"datetime.timedelta, e.g. {field}=timedelta(seconds=1)",
            job=job,
            field=field,
        )
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        kind = "zero or more" if allow_zero else "more than zero"
        raise ConfigurationError(
            f"{field}={value!r} must be a finite duration of {kind} seconds",
            job=job,
            field=field,
        )
    if seconds > MAX_DURATION_S:
        raise ConfigurationError(
            f"{field}={value!r} is longer than ten years; use a shorter duration",
            job=job,
            field=field,
        )
    if 0 < seconds < minimum_s:
        raise ConfigurationError(
            f"{field}={value!r} is below the smallest supported value of {minimum_s:g}s; "
            f"use a longer duration",
            job=job,
            field=field,
        )
    return seconds


def redact_url(url: str) -> str:
    """``url`` with any user name and password replaced, safe for logs and status pages.

    Covers both places redis-py reads a password from: ``user:password@`` and ``?password=``.
    """
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        secret_query = any(key.lower() in _SECRET_PARAMS for key, _ in query)
        if parts.username is None and parts.password is None and not secret_query:
            return url
        netloc = parts.netloc.rpartition("@")[2]
        if parts.username is not None or parts.password is not None:
            netloc = f"***@{netloc}"
        query = [(k, "***" if k.lower() in _SECRET_PARAMS else v) for k, v in query]
        return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe="*")))
    except ValueError:
        return "<unparsable url>"


def default_node_id() -> str:
    """Pod or host name, pid and a short random suffix: recognisable and unique per instance."""
    host = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{host or 'node'}-{os.getpid()}-{secrets.token_hex(2)}"


def _env_duration(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(ENV_PREFIX + name.upper())
    if raw is None or raw.strip() == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(
            f"environment variable {ENV_PREFIX}{name.upper()}={raw!r} is not a number of "
            f"seconds; set it to e.g. '3' or '0.5'",
            field=name,
        ) from None


@dataclass(frozen=True)
class Settings:
    """Validated process-wide settings of one ``SingletonJobs``."""

    project: str
    node_id: str
    redis_url: str | None
    heartbeat_interval_s: float
    lock_expiry_s: float
    max_backoff_s: float
    shutdown_timeout_s: float
    node_id_generated_in: int | None = None
    """The pid that generated a default node id (None when it was configured)."""

    @classmethod
    def build(
        cls,
        *,
        redis_url: str | None,
        has_client: bool,
        project: str | None,
        node_id: str | None,
        heartbeat_interval: Duration | None,
        lock_expiry: Duration | None,
        max_backoff: Duration | None,
        shutdown_timeout: Duration | None,
        env: Mapping[str, str] | None = None,
    ) -> Settings:
        """Merge arguments, environment and defaults, and validate the result."""
        env = os.environ if env is None else env

        def pick(value: Duration | None, name: str, default: float) -> Duration:
            if value is not None:
                return value
            from_env = _env_duration(env, name)
            return default if from_env is None else from_env

        if redis_url is None and not has_client:
            redis_url = env.get(ENV_PREFIX + "REDIS_URL") or DEFAULT_REDIS_URL
        if redis_url is not None:
            check_redis_url(redis_url)
        project = project if project is not None else env.get(ENV_PREFIX + "PROJECT")
        if project is None:
            raise ConfigurationError(
                "project is required: it namespaces every Redis key, and a shared default "
                "would let unrelated deployments elect each other; pass project='myapp' or "
                f"set {ENV_PREFIX}PROJECT",
                field="project",
            )
        check_name(project, field="project")
        node_id = node_id if node_id is not None else env.get(ENV_PREFIX + "NODE_ID")
        generated_in = None if node_id else os.getpid()
        node_id = node_id or default_node_id()
        if not isinstance(node_id, str) or not node_id.isprintable() or len(node_id) > 200:
            raise ConfigurationError(
                f"node_id={node_id!r} must be printable text of at most 200 characters",
                field="node_id",
            )
        heartbeat_s = to_seconds(
            pick(heartbeat_interval, "heartbeat_interval", 3.0),
            field="heartbeat_interval",
            minimum_s=MIN_PERIOD_S,
        )
        expiry_s = to_seconds(
            pick(lock_expiry, "lock_expiry", 10.0), field="lock_expiry", minimum_s=MIN_PERIOD_S
        )
        check_expiry(expiry_s, heartbeat_s, field="lock_expiry")
        backoff_s = to_seconds(pick(max_backoff, "max_backoff", 30.0), field="max_backoff")
        if backoff_s < heartbeat_s:
            raise ConfigurationError(
                f"max_backoff={backoff_s:g}s is below heartbeat_interval={heartbeat_s:g}s; "
                "make max_backoff at least the heartbeat interval",
                field="max_backoff",
            )
        shutdown_s = to_seconds(
            pick(shutdown_timeout, "shutdown_timeout", 10.0),
            field="shutdown_timeout",
            allow_zero=True,
        )
        return cls(
            project,
            node_id,
            redis_url,
            heartbeat_s,
            expiry_s,
            backoff_s,
            shutdown_s,
            generated_in,
        )

    def for_this_process(self) -> Settings:
        """These settings with a fresh default node id when the process was forked since it
        was generated (``gunicorn --preload`` builds the app once, then forks the workers)."""
        if self.node_id_generated_in in (None, os.getpid()):
            return self
        return dataclasses.replace(
            self, node_id=default_node_id(), node_id_generated_in=os.getpid()
        )

    def __repr__(self) -> str:
        url = None if self.redis_url is None else redact_url(self.redis_url)
        return (
            f"Settings(project={self.project!r}, node_id={self.node_id!r}, redis_url={url!r}, "
            f"heartbeat_interval_s={self.heartbeat_interval_s!r}, "
            f"lock_expiry_s={self.lock_expiry_s!r}, max_backoff_s={self.max_backoff_s!r}, "
            f"shutdown_timeout_s={self.shutdown_timeout_s!r})"
        )


def check_redis_url(url: object) -> None:
    """Reject URLs whose scheme no backend serves, without echoing credentials."""
    try:
        scheme = urlsplit(url).scheme if isinstance(url, str) else None
    except ValueError:
        scheme = None
    if scheme not in URL_SCHEMES:
        shown = redact_url(url) if isinstance(url, str) else repr(url)
        raise ConfigurationError(
            f"redis_url={shown!r} is not supported; use redis://host:port/db, "
            "rediss:// (TLS), unix:///path/to/socket or memory:// (one process only)",
            field="redis_url",
        )


def check_expiry(
    expiry_s: float, heartbeat_s: float, *, field: str, job: str | None = None
) -> None:
    """A lease must outlive several heartbeats, or one slow renewal loses it."""
    if expiry_s <= heartbeat_s:
        raise ConfigurationError(
            f"{field}={expiry_s:g}s must be longer than heartbeat_interval={heartbeat_s:g}s "
            f"(3x or more is recommended, e.g. {field}={3 * heartbeat_s:g})",
            job=job,
            field=field,
        )
    if expiry_s < 3 * heartbeat_s and not math.isclose(expiry_s, 3 * heartbeat_s):
        logger.warning(
            "%s%s=%gs is less than 3x heartbeat_interval=%gs: one late renewal can lose the "
            "lease; use %s=%g or more",
            f"job {job!r}: " if job else "",
            field,
            expiry_s,
            heartbeat_s,
            field,
            3 * heartbeat_s,
        )
