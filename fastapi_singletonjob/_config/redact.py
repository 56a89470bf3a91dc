"""Redis URLs: which ones the library accepts, and how they are shown without a secret.

Every credential redis-py accepts in a URL is redacted wherever a URL is shown (the status,
logs, ``repr``, error messages): the user info whole, and every query parameter whose value is
not known to be harmless. A URL that redis-py would misread (a ``/``, ``?`` or ``#`` typed
unescaped in a password) is refused when the settings are built, with the fix.
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import unquote_plus, urlsplit

from redis.asyncio.connection import parse_url

from .._errors import ConfigurationError
from .cluster_url import CLUSTER_SCHEMES, cluster_url_problem, seed_urls
from .url_params import query_param_problem

__all__ = ["REDACTED", "URL_SCHEMES", "check_redis_url", "redact_url"]

URL_SCHEMES: Final = ("redis", "rediss", "unix", "memory", "redis+sentinel", *CLUSTER_SCHEMES)
_C0_AND_SPACE = "".join(map(chr, range(33)))

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
_NAMED_SECRET_PARAMS = frozenset(
    {"password", "username", "user", "ssl_password", "sentinel_password", "sentinel_username"}
)
"""Secret query parameters shown by name with a redacted value (``password=***``)."""
_SHOWN_VALUE = re.compile(r"[A-Za-z0-9_.,:/+-]*")


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
    # The Sentinel form lists several hosts, separated by commas.
    hosts = host.split(",") if scheme == "redis+sentinel" else [host]
    if not all(_host_parses(scheme, one) for one in hosts) or "@" in rest[end:]:
        return f"{scheme}://{REDACTED}"
    shown = f"{scheme}://{REDACTED + '@' if at else ''}{host}{path}"
    if has_query:
        shown += "?" + "&".join(_redact_param(pair) for pair in query.split("&"))
    return shown


def _host_parses(scheme: str, host: str) -> bool:
    """Whether ``host`` is a host and an optional numeric port (not ``user:pass`` without
    its ``@``, which ``urlsplit`` would take for a host and a port); a cluster URL lists
    several, separated by commas."""
    hosts = host.split(",") if scheme.lower() in CLUSTER_SCHEMES else [host]
    try:
        for one in hosts:
            _ = urlsplit(f"{scheme}://{one}").port
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
            "rediss:// (TLS), unix:///path/to/socket, redis+cluster://host:port,host:port/ "
            "(Redis Cluster), redis+sentinel://host:26379,host2:26379/service/db (Sentinel) "
            "or memory:// (one process only)",
            field="redis_url",
        )
    assert isinstance(url, str)
    if scheme in ("memory", "redis+sentinel"):
        return  # a Sentinel URL is not redis-py's: _config.sentinel_url checks it
    cluster = scheme in CLUSTER_SCHEMES
    problem = next(
        filter(None, map(_misread_by_redis_py, seed_urls(url) if cluster else [url])), None
    )
    if problem is not None:
        raise ConfigurationError(
            f"redis_url={shown!r} {problem}; percent-encode the user name and password, "
            "e.g. urllib.parse.quote(password, safe='') turns 'p/ss#1' into 'p%2Fss%231'",
            field="redis_url",
        )
    problem = cluster_url_problem(url) if cluster else None
    if problem is None:
        first_seed = seed_urls(url)[0] if cluster else url  # the seeds share the query
        problem = query_param_problem(first_seed, cluster=cluster)
    if problem is not None:
        raise ConfigurationError(f"redis_url={shown!r} {problem}", field="redis_url")


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
