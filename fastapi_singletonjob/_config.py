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
from urllib.parse import unquote_plus, urlsplit

from redis.asyncio.connection import parse_url

from ._election import lease_deadline
from ._errors import ConfigurationError

__all__ = ["Duration", "Settings", "check_name", "redact_url", "to_seconds"]

logger = logging.getLogger("fastapi_singletonjob")

Duration = timedelta | float | int
"""A duration: a ``timedelta``, or a number of seconds."""

ENV_PREFIX: Final = "SINGLETONJOB_"
DEFAULT_REDIS_URL: Final = "redis://localhost:6379/0"
MIN_PERIOD_S: Final = 0.001
MIN_MISFIRE_GRACE_S: Final = 0.05
"""A run starts a few milliseconds after its instant (timer resolution, the event loop's
other work): a shorter ``misfire_grace`` would drop most or all instants as late."""
URL_SCHEMES: Final = ("redis", "rediss", "unix", "memory")

MAX_DURATION_S: Final = 10 * 366 * 86400.0
RENEWALS_IN_A_LEASE: Final = 2.1
"""Heartbeats the usable part of a lease must cover: the renewal that failed, the next one, and
a tenth of a heartbeat for that next renewal's round trip (the shortest call timeout)."""

REDACTED: Final = "***"
_SHOWN_QUERY_PARAMS = frozenset(
    {
        # redis-py's typed URL parameters (URL_QUERY_ARGUMENT_PARSERS): numbers and flags
        "db",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_read_size",
        "socket_keepalive",
        "retry_on_timeout",
        "max_connections",
        "health_check_interval",
        "ssl_check_hostname",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
        "ssl_min_version",
        "timeout",
        "protocol",
        "legacy_responses",
        # names and file paths, never a secret themselves
        "client_name",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
    }
)
"""Query parameters whose values are shown. redis-py passes *every* query parameter to the
connection as a keyword (``password``, ``username``, ``ssl_password``, ...), so any other
parameter is treated as a secret: an allow list, not a deny list."""
_NAMED_SECRET_PARAMS = frozenset({"password", "username", "user", "ssl_password"})
"""Secret query parameters shown by name with a redacted value (``password=***``)."""
_SHOWN_VALUE = re.compile(r"[A-Za-z0-9_.,:/+-]*")
_C0_AND_SPACE = "".join(map(chr, range(33)))
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
    """``url`` without any credential, safe for logs, reprs, errors and status pages.

    redis-py reads credentials from the user info (``user:password@``) and from *any* query
    parameter (``?password=``, ``?ssl_password=``, ...: each becomes a connection keyword). So
    the user info is replaced whole, query parameters keep their values only when they are
    known to be harmless (``db``, timeouts, flags, file paths), and the fragment is dropped.
    A URL that does not parse cleanly (a ``/``, ``?`` or ``#`` typed unescaped in a password
    moves the ``@`` out of the authority) keeps only its scheme: ``redis://***``.
    """
    url = url.lstrip(_C0_AND_SPACE).translate({ord(c): None for c in "\t\r\n"})
    scheme, sep, rest = url.partition("://")
    if not sep:
        # No authority, so no user info; anything odd may still be a mistyped secret.
        return url if not any(c in url for c in "@?#") else REDACTED
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        return REDACTED
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:].partition("#")[0]
    path, has_query, query = tail.partition("?")
    _, at, host = authority.rpartition("@")
    if not _host_parses(scheme, host) or "@" in rest[end:]:
        return f"{scheme}://{REDACTED}"
    shown = f"{scheme}://{REDACTED + '@' if at else ''}{host}{path}"
    if has_query:
        shown += "?" + "&".join(_redact_param(pair) for pair in query.split("&"))
    return shown


def _host_parses(scheme: str, host: str) -> bool:
    """Whether ``host`` is a host and an optional numeric port (not ``user:pass`` without
    its ``@``, which ``urlsplit`` would take for a host and a port)."""
    try:
        _ = urlsplit(f"{scheme}://{host}").port
    except ValueError:
        return False
    return True


def _redact_param(pair: str) -> str:
    raw_key, _, raw_value = pair.partition("=")
    key = unquote_plus(raw_key)
    if key in _SHOWN_QUERY_PARAMS:
        value = unquote_plus(raw_value)
        return f"{key}={value if _SHOWN_VALUE.fullmatch(value) else REDACTED}"
    if key in _NAMED_SECRET_PARAMS:
        return f"{key}={REDACTED}"
    return REDACTED  # an unknown name may itself be the piece of a password after a '&'


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
    precision_s: float = 0.0
    """How long before each instant the timer wakes and yields until it comes (0: off)."""
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
        precision: Duration | None = None,
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
        precision_s = to_seconds(
            pick(precision, "precision", 0.0), field="precision", allow_zero=True
        )
        if precision_s > MAX_PRECISION_S:
            raise ConfigurationError(
                f"precision={precision_s:g}s is more than {MAX_PRECISION_S:g}s of busy "
                "waiting before every instant, which costs CPU for nothing; use a few "
                "milliseconds (precision=0.002) or 0 to turn it off",
                field="precision",
            )
        return cls(
            project,
            node_id,
            redis_url,
            heartbeat_s,
            expiry_s,
            backoff_s,
            shutdown_s,
            precision_s,
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
            f"shutdown_timeout_s={self.shutdown_timeout_s!r}, precision_s={self.precision_s!r})"
        )


MAX_PRECISION_S = 0.05
"""Longest busy wait before an instant that ``precision`` admits."""


def check_redis_url(url: object) -> None:
    """Reject URLs that no backend serves or that redis-py would misread, without ever
    echoing a credential (the URL is shown as ``redact_url`` shows it)."""
    shown = redact_url(url) if isinstance(url, str) else repr(url)
    try:
        scheme = urlsplit(url).scheme if isinstance(url, str) else None
    except ValueError:
        raise ConfigurationError(
            f"redis_url={shown!r} cannot be parsed (an IPv6 host needs both brackets, "
            "e.g. redis://[::1]:6379/0); percent-encode any '[' or ']' in the password",
            field="redis_url",
        ) from None
    if scheme not in URL_SCHEMES:
        raise ConfigurationError(
            f"redis_url={shown!r} is not supported; use redis://host:port/db, "
            "rediss:// (TLS), unix:///path/to/socket or memory:// (one process only)",
            field="redis_url",
        )
    assert isinstance(url, str)
    if scheme == "memory":
        return
    problem = _misread_by_redis_py(url)
    if problem is not None:
        raise ConfigurationError(
            f"redis_url={shown!r} {problem}; percent-encode the user name and password, "
            "e.g. urllib.parse.quote(password, safe='') turns 'p/ss#1' into 'p%2Fss%231'",
            field="redis_url",
        )


def _misread_by_redis_py(url: str) -> str | None:
    """Why redis-py would not read ``url`` as written (None when it would), in words that
    quote no part of it: a '/', '?' or '#' typed unescaped in a password ends the authority
    early, and redis-py then connects to the wrong host, or fails with the password in its
    error message."""
    parts = urlsplit(url)
    if "#" in url:
        return "has a '#', which ends a URL: redis-py would ignore what follows"
    if "@" in parts.path:
        return "has an '@' after the host: the user info seems to contain a '/' or a '?'"
    if any("@" in pair.partition("=")[0] for pair in parts.query.split("&")):
        return "has an '@' in a query parameter's name: the user info seems to contain a '?'"
    try:
        _ = parts.port
    except ValueError:
        return (
            "has a port that is not a number from 0 to 65535: a password without its '@' "
            "(or with a '/', '?' or '#' before it) reads as host:port"
        )
    try:
        parse_url(url)
    except ValueError as exc:
        # redis-py's own reasons name a parameter, never its value; anything else is hidden.
        reason = re.fullmatch(r"Invalid value for '\w+' in connection URL\.", str(exc))
        return f"is refused by redis-py ({reason[0] if reason else type(exc).__name__})"
    return None


def min_lock_expiry_s(heartbeat_s: float) -> float:
    """The shortest lock expiry that rides out one failed renewal at ``heartbeat_s``, rounded
    up to the millisecond.

    A node acts on a lease only until ``lease_deadline``: the expiry less a safety margin. A
    renewal comes every heartbeat (never later); when one fails, the next one must be sent and
    answered before that deadline, so the usable part of the lease must cover
    ``RENEWALS_IN_A_LEASE`` heartbeats. Shorter leases end a term on the first failed renewal
    and leadership flaps; a lease shorter than the margin is never usable at all.
    """
    needed_s = RENEWALS_IN_A_LEASE * heartbeat_s
    low, high = needed_s, 2 * needed_s + 1.0  # the usable part is below the whole lease
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if lease_deadline(0.0, middle) < needed_s else (low, middle)
    minimum_s = math.ceil(high * 1000) / 1000
    while lease_deadline(0.0, minimum_s) < needed_s:  # guard against rounding
        minimum_s += 0.001
    return minimum_s


def _ms(seconds: float) -> str:
    """A computed duration for a message: up to millisecond precision, no exponent."""
    return f"{seconds:.3f}".rstrip("0").rstrip(".")


def check_expiry(
    expiry_s: float, heartbeat_s: float, *, field: str, job: str | None = None
) -> None:
    """A lease must ride out one failed renewal (refused otherwise), and preferably two
    (a warning below three heartbeats); see ``min_lock_expiry_s``."""
    recommended_s = max(3 * heartbeat_s, min_lock_expiry_s(heartbeat_s))
    if lease_deadline(0.0, expiry_s) < RENEWALS_IN_A_LEASE * heartbeat_s:
        max_heartbeat_s = math.floor(lease_deadline(0.0, expiry_s) / RENEWALS_IN_A_LEASE * 1000)
        lower = (
            f" or lower heartbeat_interval to at most {_ms(max_heartbeat_s / 1000)}s"
            if max_heartbeat_s / 1000 >= MIN_PERIOD_S
            else ""
        )
        raise ConfigurationError(
            f"{field}={expiry_s:g}s is too short for heartbeat_interval={heartbeat_s:g}s: "
            "a single failed renewal would end the lease (less its safety margin, it must "
            "cover two heartbeats and a round trip); raise "
            f"{field} to at least {_ms(min_lock_expiry_s(heartbeat_s))}s{lower} "
            f"(3x the heartbeat or more is recommended, e.g. {field}={_ms(recommended_s)})",
            job=job,
            field=field,
        )
    if expiry_s < 3 * heartbeat_s and not math.isclose(expiry_s, 3 * heartbeat_s):
        logger.warning(
            "%s%s=%gs is less than 3x heartbeat_interval=%gs: one late renewal can lose the "
            "lease; use %s=%s or more",
            f"job {job!r}: " if job else "",
            field,
            expiry_s,
            heartbeat_s,
            field,
            _ms(recommended_s),
        )
