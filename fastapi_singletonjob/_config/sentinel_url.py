"""Redis Sentinel given as a URL: its form and its validation.

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]
        [?sentinel_password=...&sentinel_username=...]

The hosts are the sentinels (port 26379 when left out), ``service`` is the name the sentinels
monitor (``sentinel monitor <service> ...``), ``db`` the database on the primary (0 when left
out). The user info is for the primary; the sentinels get no credentials unless
``sentinel_password`` (and ``sentinel_username``) are given, as they usually have an ACL of
their own. Every credential is percent-encoded, and redacted wherever the URL is shown.

The store built on it (``_store.redis.sentinel``) is the Redis store on a client from redis-py's
``Sentinel(...).master_for()``: its connections ask the sentinels for the primary whenever they
connect, so after a failover the next connection reaches the promoted replica.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import unquote, urlsplit

from .._errors import ConfigurationError
from .redact import redact_url

__all__ = [
    "DEFAULT_SENTINEL_PORT",
    "SENTINEL_SCHEME",
    "SentinelAddress",
    "is_sentinel_url",
    "parse_sentinel_url",
]

SENTINEL_SCHEME: Final = "redis+sentinel"
DEFAULT_SENTINEL_PORT: Final = 26379
_QUERY_PARAMS = frozenset({"sentinel_password", "sentinel_username"})
_SERVICE = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_FORM = "redis+sentinel://[user:password@]host:26379,host2:26379/<service>/<db>"


@dataclass(frozen=True)
class SentinelAddress:
    """What a Sentinel URL says: where the sentinels are, and how to reach the primary."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)


def is_sentinel_url(url: object) -> bool:
    """Whether ``url`` is of the Sentinel form (judged by its scheme alone)."""
    return isinstance(url, str) and url.lstrip().lower().startswith(SENTINEL_SCHEME + "://")


def parse_sentinel_url(url: str) -> SentinelAddress:
    """Read a Sentinel URL, or raise ``ConfigurationError`` naming ``redis_url``, the URL as
    ``redact_url`` shows it, and the fix."""

    def refuse(problem: str, fix: str = f"use {_FORM}") -> ConfigurationError:
        return ConfigurationError(
            f"redis_url={redact_url(url)!r} {problem}; {fix}", field="redis_url"
        )

    if "#" in url:
        raise refuse("has a '#', which ends a URL", _ENCODE)
    rest = url.strip().partition("://")[2]
    end = min((i for i in map(rest.find, "/?") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    path, _, query = tail.partition("?")
    if "@" in tail:
        raise refuse(
            "has an '@' after the hosts: the user info seems to hold a '/', or a query value "
            "an '@'",
            _ENCODE,
        )
    userinfo, at, hosts = authority.rpartition("@")
    sentinels = tuple(_sentinel(host, refuse) for host in hosts.split(","))
    parts = path.split("/")[1:]  # path is "" or starts with "/"
    if not parts or not _SERVICE.fullmatch(parts[0]) or len(parts) > 2:
        raise refuse(
            "does not name the service the sentinels monitor after the hosts",
            f"use {_FORM}, e.g. redis+sentinel://sentinel-1:26379,sentinel-2:26379/mymaster/0",
        )
    db_text = parts[1] if len(parts) == 2 else "0"
    if not db_text.isdigit() or not db_text.isascii():
        raise refuse("has a database that is not a whole number of 0 or more")
    credentials: dict[str, str] = {}
    for pair in filter(None, query.split("&")):
        key, _, value = (unquote(part) for part in pair.partition("="))
        if key not in _QUERY_PARAMS:
            # The parameter's name is not quoted: it may be the piece of a password after a '&'.
            raise refuse(
                "has a query parameter the Sentinel form does not take",
                "the only ones are sentinel_password= and sentinel_username= (for the "
                "sentinels), and the primary's credentials go in the user info; percent-encode "
                "a '&' in a password as %26",
            )
        credentials[key] = value
    user, _, password = userinfo.partition(":") if at else ("", "", "")
    return SentinelAddress(
        sentinels=sentinels,
        service=parts[0],
        db=int(db_text),
        username=unquote(user) or None,
        password=unquote(password) or None,
        sentinel_username=credentials.get("sentinel_username") or None,
        sentinel_password=credentials.get("sentinel_password") or None,
    )


_ENCODE = (
    "percent-encode the user name and passwords, e.g. urllib.parse.quote(password, safe='') "
    "turns 'p/ss#1' into 'p%2Fss%231'"
)


def _sentinel(host: str, refuse: Callable[..., ConfigurationError]) -> tuple[str, int]:
    """One ``host[:port]`` of the list (an IPv6 address in brackets)."""
    try:
        parts = urlsplit(f"//{host}")
        port = parts.port
    except ValueError:
        raise refuse(
            "has a sentinel address whose port is not a number from 0 to 65535 (or a "
            "password without its '@')",
            f"use {_FORM}, and {_ENCODE}",
        ) from None
    if not parts.hostname:
        raise refuse("has an empty sentinel address (a stray ',' or no host)")
    return parts.hostname, DEFAULT_SENTINEL_PORT if port is None else port
