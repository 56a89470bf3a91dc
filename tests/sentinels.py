"""A real Redis Sentinel topology for the tests: a primary, replicas and three sentinels.

Redis 7 runs as a sentinel with ``redis-server <conf> --sentinel`` (no separate binary); a
sentinel rewrites its config file, so each gets one of its own. The timings are cut down so a
promotion takes about two seconds instead of the default half minute:

    with SentinelTopology.start(tmp_path, replicas=1) as topo:
        url = topo.url()           # redis+sentinel://127.0.0.1:p1,...,/mymaster/0
        topo.primary.kill()
        new = topo.wait_promoted(old=topo.primary)
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from servers import HOST, START_TIMEOUT_S, RedisServer, find_redis_server, free_port

SERVICE = "mymaster"
DOWN_AFTER_MS = 400
"""How long a primary must be silent before a sentinel flags it down (the default is 30 s)."""
FAILOVER_TIMEOUT_MS = 2000
QUORUM = 2
PRIMARY_ARGS = ("--repl-diskless-sync-delay", "0")
_POLL_S = 0.02


class SentinelProcess:
    """One ``redis-server --sentinel`` on a free loopback port, with its own config file."""

    def __init__(self, conf: Path, password: str | None) -> None:
        self.conf = conf
        self.password = password
        self.log_path = conf.with_suffix(".log")
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def spawn(self, lines: Sequence[str]) -> None:
        self.port = free_port()
        self.conf.write_text(
            "\n".join([f"port {self.port}", f"bind {HOST}", "protected-mode no", *lines]) + "\n"
        )
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [find_redis_server(), str(self.conf), "--sentinel"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        with self.client(socket_timeout=0.25, socket_connect_timeout=0.25) as probe:
            while True:
                try:
                    probe.ping()
                    return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sentinel on {self.port} did not start: {self.log_tail()}")
                time.sleep(_POLL_S)

    def client(self, **overrides: Any) -> redis.Redis:
        options: dict[str, Any] = {
            "host": HOST,
            "port": self.port,
            "decode_responses": True,
            "socket_timeout": 5.0,
            "socket_connect_timeout": 5.0,
            "retry": Retry(NoBackoff(), 0),
            "password": self.password,
        }
        return redis.Redis(**{**options, **overrides})

    def primary_address(self) -> tuple[str, int] | None:
        with self.client() as client:
            reply = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return None if reply is None else (str(reply[0]), int(reply[1]))

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"<no log: {exc}>"

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10.0)


class SentinelTopology:
    """A primary, ``replicas`` replicas and three sentinels watching them, on loopback.

    ``password`` protects the Redis servers (``requirepass`` and ``masterauth``), and
    ``sentinel_password`` the sentinels (``requirepass`` on them); either may be None.
    """

    def __init__(self, workdir: Path, password: str | None, sentinel_password: str | None):
        self.workdir = workdir
        self.password = password
        self.sentinel_password = sentinel_password
        self.servers: list[RedisServer] = []
        self.sentinels: list[SentinelProcess] = []

    @classmethod
    def start(
        cls,
        workdir: Path,
        *,
        replicas: int = 1,
        password: str | None = None,
        sentinel_password: str | None = None,
        sentinels: int = 3,
        replicate_from: Callable[[RedisServer], int] | None = None,
    ) -> SentinelTopology:
        """``replicate_from(primary)``: the port the replicas replicate from (a ``FaultProxy``
        in front of the primary, say); the primary's own by default. The sentinels watch the
        primary directly."""
        topo = cls(workdir, password, sentinel_password)
        try:
            auth = [] if password is None else ["--requirepass", password, "--masterauth", password]
            primary = RedisServer.start(
                extra_args=[*PRIMARY_ARGS, *auth], data_dir=workdir / "primary"
            )
            topo.servers.append(primary)
            upstream = str(primary.port if replicate_from is None else replicate_from(primary))
            for i in range(replicas):
                replica = RedisServer.start(
                    extra_args=[*PRIMARY_ARGS, *auth, "--replicaof", HOST, upstream],
                    data_dir=workdir / f"replica-{i}",
                )
                topo.servers.append(replica)
                replica.wait_replica_synced()
            for i in range(sentinels):
                sentinel = SentinelProcess(workdir / f"sentinel-{i}.conf", sentinel_password)
                topo.sentinels.append(sentinel)
                sentinel.spawn(topo._sentinel_conf(primary.port))
            topo.wait_sentinels_agree(primary.port)
        except BaseException:
            topo.close()
            raise
        return topo

    def _sentinel_conf(self, primary_port: int) -> list[str]:
        lines = [
            f"dir {self.workdir}",
            f"sentinel monitor {SERVICE} {HOST} {primary_port} {QUORUM}",
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {SERVICE} 1",
        ]
        if self.password is not None:
            lines.append(f"sentinel auth-pass {SERVICE} {self.password}")
        if self.sentinel_password is not None:
            lines.append(f"requirepass {self.sentinel_password}")
            # Sentinels authenticate to each other with the password of the one they call.
            lines.append(f"sentinel sentinel-pass {self.sentinel_password}")
        return lines

    @property
    def primary(self) -> RedisServer:
        """The server the sentinels name as primary now (the first one before a failover)."""
        address = self.sentinels[0].primary_address()
        for server in self.servers:
            if address == (HOST, server.port):
                return server
        raise RuntimeError(f"the sentinels name {address}, which is none of the servers")

    def url(self, *, db: int = 0, with_passwords: bool = True) -> str:
        """The library's Sentinel URL for this topology."""
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        auth = f":{self.password}@" if with_passwords and self.password else ""
        query = (
            f"?sentinel_password={self.sentinel_password}"
            if with_passwords and self.sentinel_password
            else ""
        )
        return f"redis+sentinel://{auth}{hosts}/{SERVICE}/{db}{query}"

    def wait_sentinels_agree(self, port: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every sentinel names ``port`` as the primary and knows the other sentinels
        and the replicas (a failover needs a quorum that knows each other)."""
        deadline = time.monotonic() + timeout_s
        replicas = len(self.servers) - 1
        while True:
            if all(self._agrees(s, port, replicas) for s in self.sentinels):
                return
            if time.monotonic() > deadline:
                tails = "\n".join(s.log_tail() for s in self.sentinels)
                raise RuntimeError(f"the sentinels did not agree within {timeout_s} s:\n{tails}")
            time.sleep(_POLL_S * 5)

    def _agrees(self, sentinel: SentinelProcess, port: int, replicas: int) -> bool:
        with sentinel.client() as client:
            fields = client.sentinel_master(SERVICE)
        return (
            int(fields["port"]) == port
            and int(fields["num-other-sentinels"]) == len(self.sentinels) - 1
            and int(fields["num-slaves"]) >= replicas
        )

    def wait_promoted(self, old: RedisServer, timeout_s: float = 20.0) -> RedisServer:
        """Until a sentinel names a primary other than ``old``; that server."""
        deadline = time.monotonic() + timeout_s
        while True:
            for sentinel in self.sentinels:
                try:
                    address = sentinel.primary_address()
                except redis.RedisError:
                    continue
                for server in self.servers:
                    if server is not old and address == (HOST, server.port):
                        return server
            if time.monotonic() > deadline:
                tails = "\n".join(s.log_tail() for s in self.sentinels)
                raise RuntimeError(f"no promotion within {timeout_s} s:\n{tails}")
            time.sleep(_POLL_S)

    def close(self) -> None:
        for sentinel in self.sentinels:
            sentinel.kill()
        for server in self.servers:
            server.close()

    def __enter__(self) -> SentinelTopology:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
