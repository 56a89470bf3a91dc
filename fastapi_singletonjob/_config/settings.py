"""Settings: explicit arguments, then ``SINGLETONJOB_*`` environment variables, then defaults.

Everything is validated here, once, when ``SingletonJobs`` is built;
an error names the field, the bad value and the fix. Durations are accepted as
``datetime.timedelta`` or seconds (``int``/``float``) and normalised to float seconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import secrets
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Final, Literal, TypeGuard

from .._checkpoint import DEFAULT_CHECKPOINT_RETENTION_S
from .._errors import ConfigurationError
from .._history import DEFAULT_HISTORY, check_history
from .._timing import lease_deadline
from .redact import check_redis_url, redact_url
from .sentinel_url import is_sentinel_url, parse_sentinel_url

__all__ = ["Duration", "Settings", "check_name", "is_name", "to_seconds"]

logger = logging.getLogger("fastapi_singletonjob")

Duration = timedelta | float | int
"""A duration: a ``timedelta``, or a number of seconds."""

ENV_PREFIX: Final = "SINGLETONJOB_"
ENV_SETTINGS: Final = (
    "redis_url",
    "project",
    "node_id",
    "heartbeat_interval",
    "lock_expiry",
    "max_backoff",
    "shutdown_timeout",
    "precision",
    "checkpoint_retention",
    "placement",
    "history",
)
"""The settings that ``Settings.build`` reads from ``SINGLETONJOB_<NAME>`` variables."""
DEFAULT_REDIS_URL: Final = "redis://localhost:6379/0"
MIN_PERIOD_S: Final = 0.001

MAX_DURATION_S: Final = 10 * 366 * 86400.0
RENEWALS_IN_A_LEASE: Final = 2.1
"""Heartbeats the usable part of a lease must cover: the renewal that failed, the next one, and
a tenth of a heartbeat for that next renewal's round trip (the shortest call timeout)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
_NAME_RULE = "1-100 characters: letters, digits, '-', '_' or '.', starting with a letter or digit"


_NAME_EXAMPLES: Final = {"project": "project='myapp'", "job": "'price-tick'"}


def is_name(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a valid project or job name (``check_name``)."""
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


def check_name(value: object, *, field: str, what: Literal["project", "job"]) -> str:
    """Validate a project or job name: it becomes part of Redis keys and URLs."""
    if not is_name(value):
        raise ConfigurationError(
            f"{field}={value!r} is not a valid {what} name; use {_NAME_RULE}, "
            f"e.g. {_NAME_EXAMPLES[what]}",
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


def default_node_id() -> str:
    """Pod or host name, pid and a short random suffix: recognisable and unique per instance."""
    host = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{host or 'node'}-{os.getpid()}-{secrets.token_hex(2)}"


def check_node_id(value: object) -> str:
    """Validate a configured node id: non-blank printable text of at most 200 characters.

    An empty id is refused rather than replaced by a generated one: whoever passed it meant
    to name the node, and a silent default would hide the mistake (a template variable that
    expanded to nothing, say)."""
    fix = "leave node_id unset for the default (pod or host name, pid, random suffix)"
    if not isinstance(value, str) or not value.isprintable() or len(value) > 200:
        raise ConfigurationError(
            f"node_id={value!r} must be printable text of at most 200 characters; pass e.g. "
            f"node_id='web-1', or {fix}",
            field="node_id",
        )
    if not value.strip():
        raise ConfigurationError(
            f"node_id={value!r} is blank; pass a name such as node_id='web-1', or {fix}",
            field="node_id",
        )
    return value


def _parse_seconds(raw: str, name: str) -> float:
    """A duration read from the environment: a number of seconds, nothing else."""
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(
            f"not a number of seconds; set {ENV_PREFIX}{name.upper()} to e.g. '3' or '0.5', "
            f"or pass {name}= explicitly",
            field=name,
        ) from None


def _naming_the_variables(
    error: ConfigurationError, read: Mapping[str, tuple[str, str]]
) -> ConfigurationError:
    """``error`` with the environment variables that set the values it is about: the user
    wrote a variable, not an argument, and should find which one to fix.

    ``read`` maps each setting taken from the environment to its variable and the text shown
    for its value (nothing for a URL, which may hold a password: the message shows it
    redacted). The error's own field leads the message; other settings it names follow it.
    """
    message = str(error)
    field = error.field
    if field is not None and field in read:
        variable, shown = read[field]
        message = f"{field} (from {variable}{shown}): {message}"
    others = [name for name in read if name != field and re.search(rf"\b{name}=", str(error))]
    if others:
        message += "; " + ", ".join(f"{name} came from {''.join(read[name])}" for name in others)
    return error if message == str(error) else ConfigurationError(message, field=field)


def _warn_of_unknown_variables(env: Mapping[str, str]) -> None:
    """One WARNING naming every ``SINGLETONJOB_*`` variable (any case) that is no setting, each
    with the nearest setting's variable: a misspelt one would be ignored without a word
    (``SINGLETONJOB_LOCKEXPIRY=1`` leaves the expiry at 10 s). Names only: a value may be a
    secret."""
    known = {name.upper(): ENV_PREFIX + name.upper() for name in ENV_SETTINGS}
    unknown = sorted(
        variable
        for variable in env
        if variable.upper().startswith(ENV_PREFIX) and variable not in known.values()
    )
    if not unknown:
        return
    nearest = {
        v: difflib.get_close_matches(v[len(ENV_PREFIX) :].upper(), known, n=1) for v in unknown
    }
    named = ", ".join(f"{v} (did you mean {known[n[0]]}?)" if n else v for v, n in nearest.items())
    listed = (
        "" if all(nearest.values()) else f"; the variables it reads: {', '.join(known.values())}"
    )
    logger.warning("ignored, not a setting of fastapi-singletonjob: %s%s", named, listed)


def _naming_the_flags(
    error: ConfigurationError, flags: Mapping[str, str], read: Mapping[str, tuple[str, str]]
) -> ConfigurationError:
    """``error`` with the caller's flags for the settings it passes (``project='myapp'``
    becomes ``--project 'myapp'``): the user of a command line writes flags, not keyword
    arguments. A setting taken from the environment keeps its name (``_naming_the_variables``
    names its variable)."""
    message = str(error)
    for name, flag in flags.items():
        if name not in read:
            message = re.sub(rf"\b{name}=", f"{flag} ", message)
    return error if message == str(error) else ConfigurationError(message, field=error.field)


PlacementName = Literal["spread", "first"]
PLACEMENTS: tuple[PlacementName, ...] = ("spread", "first")


def parse_placement(value: str | None) -> PlacementName:
    """The ``placement`` setting, checked (None: the default, ``spread``)."""
    if value is None:
        return "spread"
    for known in PLACEMENTS:
        if value == known:
            return known
    raise ConfigurationError(
        f"placement={value!r} is not a placement; use placement='spread' (leadership spread "
        "over the live replicas, the default) or placement='first' (the first node to ask "
        "leads)",
        field="placement",
    )


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
    checkpoint_retention_s: float = DEFAULT_CHECKPOINT_RETENTION_S
    """How long a job's checkpoint outlives the last renewal of its lock by any node."""
    placement: PlacementName = "spread"
    """How leadership is placed: spread over the live nodes, or first come
    (``_election.placement``)."""
    history: int = DEFAULT_HISTORY
    """How many occurrences each job's history keeps (``_history``) unless the job says; 0:
    none."""

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
        checkpoint_retention: Duration | None = None,
        placement: str | None = None,
        history: int | None = None,
        env: Mapping[str, str] | None = None,
        flags: Mapping[str, str] | None = None,
    ) -> Settings:
        """Merge arguments, environment and defaults, and validate the result.

        :param flags: how the caller's user writes the settings it passes, where that is
            not as keyword arguments: the CLI's ``{"project": "--project", ...}``; the errors
            then speak of them."""
        env = os.environ if env is None else env
        _warn_of_unknown_variables(env)
        # Each setting taken from the environment: its variable, and its value as shown.
        read: dict[str, tuple[str, str]] = {}

        def from_env(name: str, *, empty_is_unset: bool = True, secret: bool = False) -> str | None:
            variable = ENV_PREFIX + name.upper()
            raw = env.get(variable)
            if raw is None or (empty_is_unset and raw.strip() == ""):
                return None
            read[name] = (variable, "" if secret else f"={raw!r}")
            return raw

        def pick(value: Duration | None, name: str, default: float) -> Duration:
            if value is not None:
                return value
            raw = from_env(name)
            return default if raw is None else _parse_seconds(raw, name)

        try:
            if redis_url is None and not has_client:
                redis_url = from_env("redis_url", secret=True) or DEFAULT_REDIS_URL
            if redis_url is not None:
                _check_url(redis_url)
            if project is None:
                # An empty SINGLETONJOB_PROJECT is an error, not "unset": see check_name.
                project = from_env("project", empty_is_unset=False)
            if project is None:
                raise ConfigurationError(
                    "project is required: it namespaces every Redis key, and a shared default "
                    "would let unrelated deployments elect each other; pass project='myapp' or "
                    f"set {ENV_PREFIX}PROJECT",
                    field="project",
                )
            check_name(project, field="project", what="project")
            if node_id is None:
                node_id = from_env("node_id")
            generated_in = None if node_id is not None else os.getpid()
            node_id = default_node_id() if node_id is None else check_node_id(node_id)
            heartbeat_s = to_seconds(
                pick(heartbeat_interval, "heartbeat_interval", 3.0),
                field="heartbeat_interval",
                minimum_s=MIN_PERIOD_S,
            )
            expiry_s = to_seconds(
                pick(lock_expiry, "lock_expiry", 10.0),
                field="lock_expiry",
                minimum_s=MIN_PERIOD_S,
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
            retention_s = _retention_s(
                pick(checkpoint_retention, "checkpoint_retention", DEFAULT_CHECKPOINT_RETENTION_S),
                expiry_s,
            )
            placed = parse_placement(placement if placement is not None else from_env("placement"))
            kept = _history(history, from_env)
        except ConfigurationError as error:
            named = _naming_the_variables(error, read)
            raise _naming_the_flags(named, flags or {}, read) from None
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
            retention_s,
            placed,
            kept,
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
            f"shutdown_timeout_s={self.shutdown_timeout_s!r}, precision_s={self.precision_s!r}, "
            f"checkpoint_retention_s={self.checkpoint_retention_s!r}, "
            f"placement={self.placement!r}, history={self.history!r})"
        )


def _history(history: int | None, from_env: Callable[[str], str | None]) -> int:
    """Validate ``history``: the argument, else ``SINGLETONJOB_HISTORY`` (a whole number's
    text), else ``DEFAULT_HISTORY``."""
    if history is not None:
        return check_history(history)
    raw = from_env("history")
    if raw is None:
        return DEFAULT_HISTORY
    text = raw.strip()
    count = int(text) if text.isascii() and text.isdigit() and len(text) < 10 else raw
    return check_history(count)


def _check_url(url: str) -> None:
    """Refuse a URL that no backend serves, or that its backend would misread."""
    check_redis_url(url)
    if is_sentinel_url(url):
        parse_sentinel_url(url)


MAX_PRECISION_S = 0.05
"""Longest busy wait before an instant that ``precision`` admits."""


def _retention_s(value: Duration, expiry_s: float) -> float:
    """Validate ``checkpoint_retention``: a checkpoint must outlive its job's lease."""
    retention_s = to_seconds(value, field="checkpoint_retention")
    if retention_s < expiry_s:
        raise ConfigurationError(
            f"checkpoint_retention={retention_s:g}s is shorter than lock_expiry={expiry_s:g}s: "
            "a checkpoint must outlive its job's lease (the default is 30 days)",
            field="checkpoint_retention",
        )
    return retention_s


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
