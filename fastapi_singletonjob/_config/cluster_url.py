"""The ``redis+cluster://`` URL form: several seed nodes of one Redis Cluster.

    redis+cluster://[user:password@]host[:port][,host[:port]...][/0][?option=value...]
    rediss+cluster://...   (TLS)

Each ``host:port`` is a seed: any node of the cluster, from which the whole topology is read
(``CLUSTER SLOTS``); one is enough, several let a node start while a seed is down. The user
info and the query string apply to every node and mean what they mean in a ``redis://`` URL.
A cluster has only database 0, so the path is empty, ``/`` or ``/0``.

Nothing here quotes the URL: the caller shows it redacted (``_config.redact``).
"""

from __future__ import annotations

from typing import Final

__all__ = ["CLUSTER_SCHEMES", "cluster_url_problem", "is_cluster_url", "seed_urls"]

CLUSTER_SCHEMES: Final = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT: Final = 6379


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` has a cluster scheme (any case)."""
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def _split(url: str) -> tuple[str, str, list[str], str]:
    """``(plain scheme, user info with its '@', seeds, path and query)``."""
    scheme, _, rest = url.partition("://")
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    userinfo, at, hosts = authority.rpartition("@")
    return scheme.lower().removesuffix("+cluster"), userinfo + at, hosts.split(","), tail


def cluster_url_problem(url: str) -> str | None:
    """What is wrong with the cluster URL ``url``, in words that quote no part of it (None
    when nothing is); the URLs of the seeds are checked further by the caller."""
    _, _, seeds, tail = _split(url)
    if any(not seed.strip() or seed.startswith(":") for seed in seeds):
        return (
            "names no host, or an empty one between commas; list the seed nodes as "
            "redis+cluster://host1:6379,host2:6379/"
        )
    path = tail.partition("?")[0].partition("#")[0]
    if path not in ("", "/", "/0"):
        return (
            "names a database other than 0: a Redis Cluster has only database 0, so end the "
            "URL with / or /0"
        )
    return None


def seed_urls(url: str) -> list[str]:
    """One plain ``redis://`` (or ``rediss://``) URL per seed of the cluster URL ``url``, with
    its user info and query string; a seed without a port gets 6379."""
    scheme, userinfo, seeds, tail = _split(url)
    urls = []
    for seed in seeds:
        has_port = seed.rpartition("]")[2].rfind(":") >= 0  # an IPv6 host has ':' inside []
        host = seed if has_port else f"{seed}:{DEFAULT_PORT}"
        urls.append(f"{scheme}://{userinfo}{host}{tail}")
    return urls
