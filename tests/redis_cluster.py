"""A real Redis Cluster for the test suite: redis-server processes with ``--cluster-enabled``.

    with TestCluster.start(masters=3, replicas=1) as cluster:
        url = cluster.url                       # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,.../
        owner = cluster.owner_of("some-key")    # the master serving the key's slot
        owner.kill()
        cluster.wait_promoted(owner)            # a replica took the slot over
        cluster.migrate_slot(slot, source, target)

Each node is a ``RedisServer`` (tests/servers.py) with a free client port and a free cluster
bus port; ``redis-cli --cluster create`` assigns the slots and the replicas. Node timeout is
short (``node_timeout_ms``), so a killed master's replica is promoted within a few seconds.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.crc import key_slot
from servers import HOST, RedisServer, free_port

from fastapi_singletonjob import JobContext, SingletonJobs

START_TIMEOUT_S = 30.0
_POLL_S = 0.05


def find_redis_cli() -> str:
    """The ``redis-cli`` binary (or valkey-cli) on PATH."""
    for name in ("redis-cli", "valkey-cli"):
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError("no redis-cli on PATH: the cluster tests need it to create a cluster")


class TestCluster:
    """A running Redis Cluster of ``masters`` masters with ``replicas`` replicas each."""

    __test__ = False  # a helper, not a test class

    def __init__(self, nodes: list[RedisServer], node_timeout_ms: int) -> None:
        self.nodes = nodes
        self.node_timeout_ms = node_timeout_ms
        self.paused: set[int] = set()
        """Ports of the nodes ``pause`` froze: they run, but answer nothing."""

    @classmethod
    def start(
        cls,
        *,
        masters: int = 3,
        replicas: int = 0,
        node_timeout_ms: int = 1000,
        data_dir: Path | None = None,
        node_args: Callable[[], Sequence[str]] = tuple,
    ) -> TestCluster:
        """Start the servers, create the cluster and return once every node reports
        ``cluster_state:ok`` and every replica has synced. ``node_args()`` gives each node's
        extra command-line arguments (a TLS port, say), called once per node."""
        nodes: list[RedisServer] = []
        cluster = cls(nodes, node_timeout_ms)
        try:
            for i in range(masters * (1 + replicas)):
                nodes.append(
                    RedisServer.start(
                        extra_args=[
                            "--cluster-enabled",
                            "yes",
                            "--cluster-node-timeout",
                            str(node_timeout_ms),
                            "--cluster-port",
                            str(free_port()),
                            "--cluster-config-file",
                            "nodes.conf",
                            # a replica whose master died takes over however long ago it
                            # last heard from it (the tests kill masters at any moment)
                            "--cluster-replica-validity-factor",
                            "0",
                            *node_args(),
                        ],  # fmt: skip
                        data_dir=None if data_dir is None else data_dir / f"node-{i}",
                    )
                )
            subprocess.run(
                [
                    find_redis_cli(),
                    "--cluster",
                    "create",
                    *(f"{HOST}:{node.port}" for node in nodes),
                    "--cluster-replicas",
                    str(replicas),
                    "--cluster-yes",
                ],  # fmt: skip
                check=True,
                capture_output=True,
                timeout=START_TIMEOUT_S,
            )
            cluster.wait_ok()
            for node in nodes:
                with node.client() as client:
                    if client.info("replication")["role"] == "slave":
                        node.wait_replica_synced()
        except BaseException:
            cluster.close()
            raise
        return cluster

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed."""
        return "redis+cluster://" + ",".join(f"{HOST}:{node.port}" for node in self.nodes) + "/"

    def running_nodes(self) -> list[RedisServer]:
        """The nodes that run and answer (not killed, not frozen by ``pause``)."""
        return [node for node in self.nodes if node.running and node.port not in self.paused]

    def pause(self, node: RedisServer) -> None:
        """SIGSTOP ``node``: it keeps its connections and accepts new ones (the kernel
        does), but answers nothing, as a frozen or partitioned master; the helpers here
        ask the other nodes from now on. ``close`` ends it."""
        node.pause()
        self.paused.add(node.port)

    def resume(self, node: RedisServer) -> None:
        """SIGCONT a node ``pause`` froze."""
        node.resume()
        self.paused.discard(node.port)

    def with_replica(self, slot: int) -> bool:
        """Whether the master serving ``slot`` has a replica connected (one that could be
        promoted). ``CLUSTER SLOTS`` is no help: it leaves out a replica for a while after
        it synced."""
        with self.slot_owner(slot).client() as client:
            return int(client.info("replication")["connected_slaves"]) > 0

    def node_at(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def slot_owner(self, slot: int) -> RedisServer:
        """The master serving ``slot``, as the running nodes see it (the first that answers)."""
        for node in self.running_nodes():
            with node.client() as client:
                for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
                    if start <= slot <= end:
                        return self.node_at(int(master[1]))
        raise RuntimeError(f"no node serves slot {slot}")

    def owner_of(self, key: str) -> RedisServer:
        return self.slot_owner(key_slot(key.encode()))

    def masters(self) -> list[RedisServer]:
        result = []
        for node in self.running_nodes():
            with node.client() as client:
                if client.info("replication")["role"] == "master":
                    result.append(node)
        return result

    def node_id(self, node: RedisServer) -> str:
        with node.client() as client:
            return str(client.execute_command("CLUSTER MYID"))

    def wait_ok(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once every running node reports ``cluster_state:ok`` and agrees on the
        owner of every slot."""
        deadline = time.monotonic() + timeout_s
        while True:
            states, maps = [], []
            for node in self.running_nodes():
                try:
                    with node.client() as client:
                        states.append(client.cluster("INFO")["cluster_state"])
                        slots = client.execute_command("CLUSTER SLOTS")
                        maps.append(sorted((s, e, int(m[1])) for s, e, m, *_ in slots))
                except redis.RedisError:
                    states.append("unreachable")
            if all(state == "ok" for state in states) and all(m == maps[0] for m in maps):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok within {timeout_s} s: {states}")
            time.sleep(_POLL_S)

    def wait_promoted(self, dead: RedisServer, slot: int, timeout_s: float = 20.0) -> float:
        """Wait until a node other than ``dead`` serves ``slot`` as a master; return the
        ``time.monotonic()`` at which that was seen."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                owner = self.slot_owner(slot)
            except (RuntimeError, redis.RedisError):
                owner = dead
            if owner is not dead:
                with owner.client() as client:
                    if client.info("replication")["role"] == "master":
                        return time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(f"slot {slot} was not taken over within {timeout_s} s")
            time.sleep(_POLL_S)

    def migrate_slot(
        self, slot: int, source: RedisServer, target: RedisServer, *, hold_s: float = 0.0
    ) -> None:
        """Move ``slot`` with its keys from ``source`` to ``target``, the way
        ``redis-cli --cluster reshard`` does: IMPORTING/MIGRATING, MIGRATE of every key, then
        SETSLOT NODE on both sides and on every other master. ``hold_s`` keeps the slot
        half-migrated that long (keys moved, slot still MIGRATING/IMPORTING), as a reshard of
        many keys, or one that stalls, does."""
        source_id, target_id = self.node_id(source), self.node_id(target)
        with target.client() as dst, source.client() as src:
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
            while True:
                keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
                if not keys:
                    break
                src.execute_command("MIGRATE", HOST, target.port, "", 0, 5000, "KEYS", *keys)
            if hold_s:
                time.sleep(hold_s)  # the fault's duration, not a wait for a condition
            dst.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
            src.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        for node in self.masters():
            if node not in (source, target):
                with node.client() as client:
                    client.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> TestCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass
class Run:
    """One run of a ``ticking_node``'s job: which node, in which term, when."""

    node: str
    token: int
    start: float
    end: float | None = None


def ticking_node(
    url: str | None,
    project: str,
    name: str,
    runs: list[Run],
    *,
    tick_s: float = 0.02,
    checkpoint: bool = False,
    **settings: Any,
) -> SingletonJobs:
    """A node with one interval job, ``tick``, that records each of its runs in ``runs``."""
    jobs = SingletonJobs(url, project=project, node_id=name, **settings)

    @jobs.interval("tick", tick_s, checkpoint=checkpoint)
    async def tick(ctx: JobContext) -> None:
        run = Run(name, ctx.fencing_token, time.monotonic())
        runs.append(run)
        run.end = time.monotonic()

    return jobs
