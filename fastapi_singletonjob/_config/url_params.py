"""The query parameters of a Redis URL, checked against what will take them.

redis-py's ``parse_url`` turns every query parameter into a keyword argument of the URL's
connection class (``Connection``, ``SSLConnection`` for ``rediss://``,
``UnixDomainSocketConnection`` for ``unix://``); a cluster URL's go to ``RedisCluster``. A name
that class does not take (a typo such as ``socket_timout``, or ``ssl_cert_reqs`` on a plain
``redis://``) would pass startup and then fail every connection, each election round, with a
``TypeError``; on a cluster it would be dropped without a word. So each name is checked here,
when the settings are built. (The Sentinel form takes its own two parameters:
``_config.sentinel_url``.)

A parameter's name is quoted only when it reads as a misspelt parameter (a lower-case
identifier close to a real one) or is a TLS parameter: anything else may be the piece of a
password after an unescaped ``&``, and is not shown, as ``redact_url`` does not show it.
"""

from __future__ import annotations

import difflib
import inspect
import re
from functools import cache
from typing import Final

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, SSLConnection, parse_url

__all__ = ["query_param_problem"]

_FROM_THE_URL: Final = frozenset({"connection_class"})
"""What ``parse_url`` adds itself, from the scheme."""
_NAME_LIKE = re.compile(r"[a-z][a-z0-9_]{0,60}")
_CLOSE: Final = 0.8
"""``difflib`` similarity from which a name reads as a misspelling of a parameter (a
transposed, missing or doubled letter in a name of ten or more), not as stray text."""
_COMMON = "db, socket_timeout, socket_connect_timeout, client_name, health_check_interval"


@cache
def accepted_keywords(target: type) -> frozenset[str]:
    """The keyword arguments ``target(...)`` takes: its ``__init__``'s named parameters and,
    while it passes ``**kwargs`` on, those of the classes it inherits from."""
    names: set[str] = set()
    for klass in target.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        names.update(
            p.name
            for p in parameters
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
        )
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return frozenset(names)


def query_param_problem(url: str, *, cluster: bool) -> str | None:
    """What is wrong with the query parameters of ``url`` (a ``redis://``, ``rediss://`` or
    ``unix://`` URL, or one seed of a cluster URL with ``cluster``), in words that quote no
    secret; None when every one is taken. ``url`` is one that ``parse_url`` reads."""
    options = parse_url(url)
    connection = options.get("connection_class", Connection)
    tls = issubclass(connection, SSLConnection)
    target: type = RedisCluster if cluster else connection
    taken = accepted_keywords(target)
    for name in sorted(set(options) - _FROM_THE_URL):
        if name.startswith("ssl_") and not tls and name in accepted_keywords(SSLConnection):
            tls_scheme = "rediss+cluster://" if cluster else "rediss://"
            return (
                f"has the TLS parameter {name}= on a URL without TLS; use {tls_scheme} to "
                "connect over TLS, or drop the ssl_* parameters"
            )
        if name in taken:
            continue
        where = f"redis-py's {target.__name__}"
        close = difflib.get_close_matches(name, sorted(taken), n=1, cutoff=_CLOSE)
        if close and _NAME_LIKE.fullmatch(name):
            return (
                f"has the query parameter {name}=, which {where} does not take: every "
                f"connection would fail; did you mean {close[0]}=?"
            )
        # Not quoted: it may be the piece of a password after a '&'.
        return (
            f"has a query parameter that {where} does not take (its name is not shown: it "
            f"may be part of a password after an unescaped '&'); the common ones are {_COMMON}, "
            "and a '&' in a password is percent-encoded as %26"
        )
    return None
