"""Redis Cluster behind TLS, for real: six redis-servers (three masters, a replica each) that
speak TLS to clients, on the cluster bus and between master and replica
(``--tls-cluster yes``, ``--tls-replication yes``), each requiring a client certificate of a
CA made by ``trustme``; the library gets only the TLS ports, in a ``rediss+cluster://`` URL.

Over TLS, as over plain TCP: one runner, a graceful handover pushed by the sharded release
notice, a SIGKILL of the slot's master survived through its replica's promotion (no overlap,
tokens increasing), and a client that trusts another CA reported by readiness. Each node also
listens on a plain port, which only the test harness uses (``redis-cli --cluster create``,
checking the cluster's state)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from chaos.test_cluster_faults import (
    check_tokens,
    kill_slot_master,
    overlap_s,
    pushed_handover,
    subscribers,
)
from redis.crc import key_slot
from redis_cluster import Run, TestCluster, ticking_node
from servers import HOST, free_port
from test_redis_tls import PREFIX, serve, tls_error_reported, write_pems
from waiting import wait_until

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._store.keys import job_key, release_channel

pytestmark = pytest.mark.redis

H = 0.2  # heartbeat, also the connect timeout: a TLS handshake on a busy machine needs it
T = 1.0  # lock expiry
B = 0.5  # max backoff
NODE_TIMEOUT_MS = 1000


@dataclass
class TlsCluster:
    cluster: TestCluster
    pems: dict[str, Path]
    tls_port: dict[int, int]
    """The TLS port of each node, by its plain port."""

    def url(self, ca: Path | None = None) -> str:
        seeds = ",".join(f"{HOST}:{port}" for port in self.tls_port.values())
        return (
            f"rediss+cluster://{seeds}/?ssl_ca_certs={ca or self.pems['ca']}"
            f"&ssl_certfile={self.pems['client']}&ssl_keyfile={self.pems['client-key']}"
        )


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsCluster]:
    pems = write_pems(tmp_path_factory.mktemp("pki"), trustme.CA())
    tls_ports: list[int] = []

    def tls_args() -> list[str]:
        tls_ports.append(free_port())
        return [
            *("--tls-port", str(tls_ports[-1]), "--tls-auth-clients", "yes"),
            *("--tls-cert-file", str(pems["server"]), "--tls-key-file", str(pems["server-key"])),
            *("--tls-ca-cert-file", str(pems["ca"])),
            *("--tls-cluster", "yes", "--tls-replication", "yes"),
        ]

    with TestCluster.start(
        masters=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS, node_args=tls_args
    ) as cluster:
        ports = dict(zip((node.port for node in cluster.nodes), tls_ports, strict=True))
        yield TlsCluster(cluster, pems, ports)


def make_node(url: str, project: str, name: str, runs: list[Run]) -> SingletonJobs:
    return ticking_node(
        url, project, name, runs, heartbeat_interval=H, lock_expiry=T, max_backoff=B
    )


async def test_one_runner_and_a_pushed_handover_over_tls(
    tls_cluster: TlsCluster, unique_project: str
) -> None:
    runs: list[Run] = []
    a, b = (make_node(tls_cluster.url(), unique_project, name, runs) for name in ("a", "b"))
    async with a, b:
        await wait_until(lambda: len(runs) >= 20, 10.0, "20 runs over TLS")
        assert len(check_tokens(runs)) == 1 and len({run.node for run in runs}) == 1
        for jobs in (a, b):
            store = jobs.status().store
            assert store.reachable and store.error is None, store
        handover_s = await pushed_handover(a, b)
        await wait_until(lambda: len(check_tokens(runs)) == 2, 2 * T, "runs of the new term")
    print(f"TLS cluster: graceful handover {handover_s * 1000:.1f} ms")
    assert handover_s < 0.3, "the sharded release notice arrives over TLS"
    assert len(check_tokens(runs)) == 2  # in order, or check_tokens fails
    assert overlap_s(runs) == 0.0


async def test_a_slot_master_sigkill_is_survived_over_tls(
    tls_cluster: TlsCluster, unique_project: str
) -> None:
    cluster = tls_cluster.cluster
    runs: list[Run] = []
    slot = key_slot(job_key(unique_project, "tick", "lock").encode())
    a, b = (make_node(tls_cluster.url(), unique_project, name, runs) for name in ("a", "b"))
    channel = release_channel(unique_project)
    async with a, b:
        await wait_until(lambda: len(runs) >= 20, 10.0, "steady runs over TLS")
        await wait_until(lambda: subscribers(cluster, channel) == 2, 5.0, "2 listeners")
        killed_at, promoted_at, resumed_at = await kill_slot_master(
            cluster, slot, runs, lock_expiry_s=T, timeout_s=10.0
        )
        # The handover is pushed only to a listener: both subscribe again on the new master.
        await wait_until(
            lambda: subscribers(cluster, channel) == 2, 10.0, "listeners on the new master"
        )
        handover_s = await pushed_handover(a, b)
    print(
        f"TLS cluster, slot master SIGKILL: promoted {promoted_at - killed_at:.2f} s after the "
        f"kill, runs resumed {resumed_at - promoted_at:.2f} s after the promotion; terms "
        f"{len(check_tokens(runs))}; handover afterwards {handover_s * 1000:.1f} ms"
    )
    assert overlap_s(runs) == 0.0
    check_tokens(runs)  # fencing tokens never go back
    # Detection and promotion, then a heartbeat (the listener wakes the election); slack for
    # redis-py re-reading the slot map, slower over TLS and on a loaded machine.
    assert resumed_at - promoted_at < H + 1.0
    assert handover_s < 0.3, "the listeners followed the slot to the new master, over TLS"


async def test_a_client_trusting_another_ca_is_reported_by_readiness(
    tls_cluster: TlsCluster, unique_project: str, tmp_path: Path
) -> None:
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    runs: list[Run] = []
    jobs = make_node(tls_cluster.url(ca=other_ca), unique_project, "a", runs)
    async with serve(jobs) as client:
        reasons = await tls_error_reported(client, 10.0)
        live = await client.get(f"{PREFIX}/health/live")
    assert live.status_code == 200, "a TLS mismatch is not a liveness failure"
    assert runs == []
    assert str(tls_cluster.pems["client-key"]) not in reasons[-1]
