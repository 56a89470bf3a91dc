"""Values in Redis that the library did not expect, on a real redis-server: whatever a shared key
holds, the election goes on, ``GET /cluster`` answers 200 and the CLI works (issue 26, item 5).

Each shared key of a project gets each odd value: a key of another type, non-ASCII digits, a
5,000-digit number, ``nan``, ``inf``, ``-1``, ``""``, bad JSON, JSON of another shape, bytes
that are not UTF-8. The odd entry reads as absent; a reader says so at WARNING once, however
often it reads it; the script that owns the key deletes or replaces it (and the node says so,
once). Lock values are the exception: a foreign one stays, nobody's (docs/design.md).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from servers import RedisServer
from waiting import wait_until

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._checkpoint import FinishedRun, StateSave
from fastapi_singletonjob._cli import EXIT_OK, main
from fastapi_singletonjob._lock_value import is_lock_value, parse_lock_value
from fastapi_singletonjob._outcomes import Outcome
from fastapi_singletonjob._store import keys as _keys
from fastapi_singletonjob._store.base import ClaimResult, LeaseReply, LeaseRequest
from fastapi_singletonjob._store.membership import MemberRecord, Membership
from fastapi_singletonjob._store.records import last_us
from fastapi_singletonjob._store.redis.store import RedisLeaseStore

pytestmark = pytest.mark.redis

TTL_S = 5.0
JOBS = ("job", "other")
"""The node's jobs: the odd value goes into the keys of ``job``; ``other`` must go on."""

ODD_VALUES: dict[str, str | bytes] = {
    "superscript-two": "\u00b2",  # str.isdigit() accepts it, int() refuses it
    "arabic-indic": "\u0661\u0662",  # int() reads it, but no script writes it
    "5000-digits": "9" * 5000,  # past int()'s default limit of digits; inf for Lua
    "nan": "nan",  # Lua's tonumber() reads it as NaN
    "inf": "inf",
    "minus-one": "-1",
    "empty": "",
    "bad-json": "{",
    "json-list": "[1, 2]",
    "json-number": "7",
    "not-utf8": b"\xff\xfe",
}
OTHER_TYPES = ("string", "list")
"""A key of another type than a hash or a sorted set, for the keys that are one."""

READ_ONCE = "not a value this library writes"
"""In the WARNING of a reader that left an odd value out (``_odd``)."""
DELETED = "(no node of this library writes that)"
"""In the WARNING of a node whose ``ELECT`` deleted an odd value."""


def param_values(values: dict[str, Any] = ODD_VALUES) -> pytest.MarkDecorator:
    """Parametrize ``odd`` with ``values``, named by their keys."""
    return pytest.mark.parametrize("odd", values.values(), ids=values.keys())


def warned(caplog: pytest.LogCaptureFixture, kind: str, marker: str) -> list[str]:
    """The WARNINGs of ``kind`` (``READ_ONCE``, ``DELETED``) that mention ``marker``."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING
        and kind in record.getMessage()
        and marker in record.getMessage()
    ]


class Node:
    """One node of a project, straight on the store: it runs ``JOBS``, announces a membership
    record, and each ``round`` renews the locks it holds (or takes them)."""

    def __init__(self, redis_url: str, project: str, name: str = "n1") -> None:
        self.project = project
        self.url = redis_url
        self.owner = f"{name}#{project}"
        self.store = RedisLeaseStore(project, url=redis_url)
        jobs = dict.fromkeys(JOBS, "every 1s")
        record = MemberRecord(name, self.owner, "0", datetime.now(UTC), jobs, TTL_S)
        self.membership = Membership(record)
        self.store.announce(self.membership)
        self.values: dict[str, str | None] = dict.fromkeys(JOBS)

    async def round(self) -> dict[str, LeaseReply]:
        requests = [LeaseRequest(job, TTL_S, self.values[job]) for job in JOBS]
        replies = await self.store.elect(self.owner, requests)
        for reply in replies:
            self.values[reply.job] = reply.value if reply.held else None
        return {reply.job: reply for reply in replies}

    def key(self, name: _keys.ProjectKey) -> str:
        return _keys.project_key(self.project, name)

    def job_key(self, kind: _keys.JobKey, job: str = "job") -> str:
        return _keys.job_key(self.project, job, kind)

    async def cluster(self) -> dict[str, Any]:
        """``GET /cluster`` of a replica that registers ``JOBS`` (not started: it reads
        Redis); it must answer 200 and show ``other`` led by this node."""
        jobs = SingletonJobs(self.url, project=self.project)
        for name in JOBS:
            jobs.fixed_rate(name, every=1.0)(_idle)
        app = FastAPI()
        app.include_router(jobs.router)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.get("/cluster")
        assert response.status_code == 200, response.text
        view: dict[str, Any] = response.json()
        shown = {job["name"]: job for job in view["jobs"]}
        assert shown["other"]["leader"] == "n1"
        return view

    async def cli(self, *args: str) -> str:
        """Run the CLI on this project; it must exit 0."""
        out = io.StringIO()
        argv = ["--redis-url", self.url, "--project", self.project, *args]
        code = await asyncio.to_thread(main, argv, out)
        assert code == EXIT_OK, (args, out.getvalue())
        return out.getvalue()


async def _idle() -> None:
    pass


@pytest.fixture
async def node(redis_url: str, unique_project: str) -> AsyncIterator[Node]:
    """A node that leads both its jobs."""
    node = Node(redis_url, unique_project)
    try:
        replies = await node.round()
        assert all(reply.held for reply in replies.values())
        yield node
    finally:
        await node.store.aclose()


def plant_type(server: RedisServer, key: str, kind: str) -> None:
    """Replace ``key`` with a key of type ``kind`` ("string", "list" or "hash")."""
    with server.client() as client:
        client.delete(key)
        if kind == "string":
            client.set(key, "odd")
        elif kind == "list":
            client.rpush(key, "odd")
        else:
            client.hset(key, "odd", "1")


def plant(server: RedisServer, key: str, odd: Any) -> None:
    """Set ``key`` to ``odd``: a value, or a hash (dict) or a list."""
    with server.client() as client:
        client.delete(key)
        if isinstance(odd, dict):
            client.hset(key, mapping=odd)
        elif isinstance(odd, list):
            client.rpush(key, *odd)
        else:
            client.set(key, odd)


def redis_type(server: RedisServer, key: str) -> str:
    with server.client() as client:
        return str(client.type(key))


async def renews_both(node: Node) -> None:
    """A round in which the node still holds both jobs, with the values it held."""
    held = dict(node.values)
    replies = await node.round()
    assert {job: (reply.held, reply.value) for job, reply in replies.items()} == {
        job: (True, held[job]) for job in JOBS
    }


# -- many at once ---------------------------------------------------------------------------


async def test_elect_drops_any_number_of_expired_membership_records(
    redis_server: RedisServer, redis_url: str, unique_project: str
) -> None:
    """9,000 records expiring together (a fleet that reconnects after an outage) are all
    dropped by the next ``ELECT``, which still answers: Lua's ``unpack`` takes about 8,000
    values at most, and one call of it failed every round of every node, for good."""
    expired = 9_000
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    with redis_server.client() as client:
        pipe = client.pipeline(transaction=False)
        for i in range(expired):
            owner = f"web-{i}#{i:08x}"
            pipe.hset(_keys.project_key(unique_project, "nodes"), owner, "{}")
            pipe.zadd(_keys.project_key(unique_project, "nodes:expiry"), {owner: now_ms - 1000})
            pipe.hset(
                _keys.project_key(unique_project, "nodes:placement"),
                owner,
                f"{now_ms - 60_000}|0123456789abcdef",
            )
        pipe.execute()
    store = RedisLeaseStore(unique_project, url=redis_url)
    record = MemberRecord("n1", "n1#00", "0", datetime.now(UTC), {"job": "every 1s"}, TTL_S)
    store.announce(Membership(record))
    try:
        replies = await store.elect("n1#00", [LeaseRequest("job", TTL_S)])
    finally:
        await store.aclose()
    assert [reply.held for reply in replies] == [True]
    with redis_server.client() as client:
        assert client.zcard(_keys.project_key(unique_project, "nodes:expiry")) == 1
        assert client.hlen(_keys.project_key(unique_project, "nodes")) == 1
        placement = client.hkeys(_keys.project_key(unique_project, "nodes:placement"))
        assert sorted(placement) == ["#epoch", "n1#00"]


# -- the project's keys ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", OTHER_TYPES)
@pytest.mark.parametrize("name", ["nodes", "nodes:expiry", "nodes:placement", "controls"])
async def test_a_project_key_of_another_type_is_deleted_by_the_next_round(
    node: Node,
    redis_server: RedisServer,
    name: _keys.ProjectKey,
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A shared key of another type: the cluster view reads it as empty (said once), and the
    next ``ELECT`` deletes it; before, ``WRONGTYPE`` failed every round of every node and
    the view (503), for good. The CLI's status and pause work throughout."""
    key = node.key(name)
    plant_type(redis_server, key, kind)
    await node.cluster()
    await node.cluster()
    await node.cli("status")
    if name == "controls":  # CONTROL deletes it too, before any round
        await node.cli("trigger", "job")
    if name != "nodes:placement":  # which the view does not read
        assert len(warned(caplog, READ_ONCE, key)) == 1
    await renews_both(node)
    assert redis_type(redis_server, key) != kind
    await renews_both(node)  # the record sent whole again, if it was lost
    if name == "controls":  # deleted by the CONTROL call: said in the server's log only
        assert f"singletonjob: deleted {key}, a {kind}" in redis_server.log_tail(1000)
    else:
        assert len(warned(caplog, DELETED, key)) == 1
    view = await node.cluster()
    assert [n["owner"] for n in view["nodes"]] == [node.owner]
    await node.cli("pause", "job")
    assert (await node.round())["job"].paused


# -- the placement hash -----------------------------------------------------------------------


PLACEMENT_ENTRIES = {
    **{name: value for name, value in ODD_VALUES.items() if isinstance(value, str)},
    **{
        f"{name}|digest": f"{value}|0123456789abcdef"
        for name, value in ODD_VALUES.items()
        if isinstance(value, str)
    },
    "16-digits|digest": f"{'1' * 16}|0123456789abcdef",
    "not-utf8|digest": b"\xff|0123456789abcdef",
}


@param_values(PLACEMENT_ENTRIES)
async def test_an_odd_placement_entry_is_deleted_and_the_election_goes_on(
    node: Node,
    redis_server: RedisServer,
    odd: str | bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A field of ``nodes:placement`` that no node wrote (another tool, a hand) is deleted by
    the first ``ELECT`` that reads the hash, said once, and left out of placement; before,
    its ``int()`` raised in every node's round, for good, and readiness blamed Redis."""
    placement, owner = node.key("nodes:placement"), f"other#{node.project}"
    with redis_server.client() as client:
        client.hset(placement, owner, odd)
        client.hincrby(placement, "#epoch", 1)  # every node reads the placement again
    await renews_both(node)
    await renews_both(node)
    assert set(node.membership.peers) == {node.owner}
    with redis_server.client() as client:
        assert not client.hexists(placement, owner)
    assert len(warned(caplog, DELETED, owner)) == 1


async def test_a_placement_entry_without_a_member_is_deleted(
    node: Node, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry of the right form whose owner has no expiry (a ghost: no ``ELECT`` wrote
    it, so none would ever drop it) is deleted when the hash is read: placement never
    prefers a node that does not exist."""
    placement, ghost = node.key("nodes:placement"), f"ghost#{node.project}"
    with redis_server.client() as client:
        client.hset(placement, ghost, f"1|{node.membership.digest}")
        client.hincrby(placement, "#epoch", 1)
    await renews_both(node)
    assert set(node.membership.peers) == {node.owner}
    with redis_server.client() as client:
        assert not client.hexists(placement, ghost)
    assert len(warned(caplog, DELETED, ghost)) == 1


ODD_EPOCHS = {
    **{name: value for name, value in ODD_VALUES.items() if value != "7"},  # "7" counts
    "19-digits": "9" * 19,  # past what HINCRBY can raise
    "fraction": "1.5",
}


@param_values(ODD_EPOCHS)
async def test_an_odd_placement_epoch_restarts_and_a_later_member_is_seen(
    node: Node,
    redis_server: RedisServer,
    redis_url: str,
    odd: str | bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An ``#epoch`` that is not a count is restarted by the next ``ELECT``; before, no
    ``HINCRBY`` could raise it again, so a node that had read it never read the placement
    again: a member that joined later was never seen (spread placement frozen)."""
    placement = node.key("nodes:placement")
    with redis_server.client() as client:
        client.hset(placement, "#epoch", odd)
    await renews_both(node)
    second = Node(redis_url, node.project, "n2")
    try:
        await second.round()  # joins: the epoch is raised
        await renews_both(node)
    finally:
        await second.store.aclose()
    assert set(node.membership.peers) == {node.owner, second.owner}
    with redis_server.client() as client:
        assert str(client.hget(placement, "#epoch")).isdigit()
    assert len(warned(caplog, DELETED, "#epoch")) == 1


# -- membership records and expiries --------------------------------------------------------

RECORD_SHAPES: dict[str, str | bytes] = {
    **ODD_VALUES,
    "json-string": '"n1"',
    "deep-json": "[" * 100_000,
    "another-owner": '{"node_id": "n1", "owner": "n9#0", "started_at": "2026-01-01T00:00+00:00"}',
}


def record_json(owner: str) -> str:
    """A record of the right form for ``owner``."""
    node_id = owner.partition("#")[0]
    return MemberRecord(
        node_id, owner, "0", datetime.now(UTC), {"job": "every 1s"}, TTL_S
    ).to_json()


def record_of(node: Node, **changes: Any) -> str:
    """``node``'s record as stored, with ``changes`` (raw JSON values by field)."""
    fields = json.loads(node.membership.record.to_json())
    text = json.dumps({**fields, **dict.fromkeys(changes, "@")})
    for name, raw in changes.items():
        text = text.replace(f'"{name}": "@"', f'"{name}": {raw}')
    return text


def record_shapes(node: Node) -> dict[str, str | bytes]:
    """Odd records that name ``node`` as their owner: only a field is wrong."""
    return {
        "ttl-infinite": record_of(node, ttl_s="Infinity"),
        "ttl-nan": record_of(node, ttl_s="NaN"),
        "ttl-1e308": record_of(node, ttl_s="1e308"),
        "ttl-4000-digits": record_of(node, ttl_s="9" * 4000),
        "ttl-negative": record_of(node, ttl_s="-1"),
        "jobs-a-string": record_of(node, jobs='"job"'),
    }


CALLER_RECORDS = [
    *RECORD_SHAPES,
    *("ttl-infinite", "ttl-nan", "ttl-1e308", "ttl-4000-digits", "ttl-negative", "jobs-a-string"),
]


@pytest.mark.parametrize("shape", CALLER_RECORDS)
async def test_an_odd_record_of_the_caller_is_written_again(
    node: Node, redis_server: RedisServer, shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The node's own record replaced by something else: the cluster view leaves the node
    out (said once) and still answers; the node's next ``ELECT`` deletes it and the one
    after writes it again. Before, the record stayed odd for as long as the node lived, and
    the view and the CLI did not know the node or the jobs only it runs (a record with an
    infinite ``ttl_s`` failed the view: 500)."""
    odd = RECORD_SHAPES[shape] if shape in RECORD_SHAPES else record_shapes(node)[shape]
    nodes = node.key("nodes")
    with redis_server.client() as client:
        client.hset(nodes, node.owner, odd)
    for _ in range(2):
        assert (await node.cluster())["nodes"] == []
    await node.cli("status")
    assert len(warned(caplog, READ_ONCE, node.owner)) == 1
    await renews_both(node)
    await renews_both(node)
    with redis_server.client() as client:
        assert client.hget(nodes, node.owner) == node.membership.record.to_json()
    assert [n["owner"] for n in (await node.cluster())["nodes"]] == [node.owner]
    assert len(warned(caplog, DELETED, node.owner)) == 1


@param_values(
    {
        **RECORD_SHAPES,
        "naive-start": '{"node_id": "n2", "started_at": "2026-01-01T00:00:00", "jobs": {}}',
        "ttl-infinite": '{"node_id": "n2", "started_at": "2026-01-01T00:00:00+00:00", '
        '"jobs": {}, "ttl_s": Infinity}',
    }
)
async def test_an_odd_record_of_another_node_is_left_out_of_the_view(
    node: Node, redis_server: RedisServer, odd: str | bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Another live owner's record that is not one: the view leaves it out and says so once;
    the others are shown. (Its owner's next ``ELECT`` writes it again; a record without
    a start's offset made the CLI's status fail, one with an infinite lifetime the view.)"""
    other = f"n2#{node.project}"
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    with redis_server.client() as client:
        client.hset(node.key("nodes"), other, odd)
        client.zadd(node.key("nodes:expiry"), {other: now_ms + 60_000})
        client.hset(node.key("nodes:placement"), other, f"{now_ms}|0123456789abcdef")
    for _ in range(2):
        view = await node.cluster()
        assert [n["owner"] for n in view["nodes"]] == [node.owner]
    await node.cli("status")
    await renews_both(node)
    assert len(warned(caplog, READ_ONCE, other)) == 1


async def test_a_record_without_an_expiry_is_deleted(
    node: Node, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A record whose owner has no expiry (no ``ELECT`` wrote it, so none would drop it) is
    deleted by the next ``ELECT``."""
    ghost = f"ghost#{node.project}"
    with redis_server.client() as client:
        client.hset(node.key("nodes"), ghost, record_json(ghost))
    await renews_both(node)
    with redis_server.client() as client:
        assert not client.hexists(node.key("nodes"), ghost)
    assert len(warned(caplog, DELETED, ghost)) == 1


ODD_EXPIRIES = {"infinite": "inf", "1e300": "1e300", "in-11-years": "11y"}
EXPIRED = {"minus-infinite": "-inf", "minus-one": "-1"}


@param_values({**ODD_EXPIRIES, **EXPIRED})
async def test_an_expiry_that_never_comes_is_deleted_with_its_member(
    node: Node, redis_server: RedisServer, odd: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An expiry further ahead than any record lives (no ``ELECT`` wrote it: the member would
    never expire) is left out of the view, said once, and deleted with the member's record
    and placement entry by the next ``ELECT``; before, ``datetime.fromtimestamp`` of it
    failed the view (500) and the CLI (exit 1), and the member stayed for ever. One already
    past is expired: left out, and deleted, as ever."""
    ghost = f"ghost#{node.project}"
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    score = now_ms + 11 * 366 * 86_400_000 if odd == "11y" else float(odd)
    with redis_server.client() as client:
        client.hset(node.key("nodes"), ghost, record_json(ghost))
        client.zadd(node.key("nodes:expiry"), {ghost: score})
        client.hset(node.key("nodes:placement"), ghost, f"{now_ms}|0123456789abcdef")
    for _ in range(2):
        view = await node.cluster()
        assert [n["owner"] for n in view["nodes"]] == [node.owner]
    await node.cli("status")
    await renews_both(node)
    await renews_both(node)
    with redis_server.client() as client:
        assert client.zscore(node.key("nodes:expiry"), ghost) is None
        assert not client.hexists(node.key("nodes"), ghost)
        assert not client.hexists(node.key("nodes:placement"), ghost)
    if odd in ODD_EXPIRIES.values():
        assert len(warned(caplog, READ_ONCE, ghost)) == 1
        assert len(warned(caplog, DELETED, ghost)) == 1


# -- the controls ---------------------------------------------------------------------------


@param_values()
async def test_an_odd_paused_control_still_pauses_and_the_view_answers(
    node: Node, redis_server: RedisServer, odd: str | bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``paused:<job>`` control that ``pause()`` did not write: the job is paused (the
    field's presence pauses it), the view shows no time for it and says so once, and the
    CLI's resume deletes it."""
    field = _keys.control_field("paused", "job")
    with redis_server.client() as client:
        client.hset(node.key("controls"), field, odd)
    for _ in range(2):
        shown = {job["name"]: job for job in (await node.cluster())["jobs"]}
        assert (shown["job"]["paused"], shown["job"]["paused_at"]) == (True, None)
    replies = await node.round()
    assert replies["job"].held and replies["job"].paused and not replies["other"].paused
    assert len(warned(caplog, READ_ONCE, field)) == 1
    await node.cli("resume", "job")
    assert not (await node.round())["job"].paused


ODD_FIELDS = {
    **{name: value for name, value in ODD_VALUES.items() if isinstance(value, str)},
    "not-utf8": b"\xff\xfe",
    "unknown-control": "frozen:job",
    "colon-only": ":",
}


@param_values(ODD_FIELDS)
async def test_an_odd_control_field_is_ignored(
    node: Node, redis_server: RedisServer, odd: str | bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A field of the controls hash that is not ``<control>:<job>``: the election and the
    view ignore it (the view says so once); it is kept, as a future version's control may
    look like it."""
    with redis_server.client() as client:
        client.hset(node.key("controls"), odd, "1")
    await node.cluster()
    await node.cluster()
    await node.cli("status")
    replies = await node.round()
    assert not any(reply.paused or reply.triggered for reply in replies.values())
    shown = odd.decode(errors="replace") if isinstance(odd, bytes) else odd
    assert len(warned(caplog, READ_ONCE, repr(shown[:40]))) == 1


# -- a job's keys ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hash", "list"])
async def test_a_lock_key_of_another_type_is_foreign_and_the_other_jobs_go_on(
    node: Node, redis_server: RedisServer, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock key of another type is foreign, like a lock value of another form: no node
    takes the job until it is deleted (or expires), the others are renewed, the view shows
    no leader for it and says so once; before, ``WRONGTYPE`` failed every round of every
    node. It is not deleted: the library never overwrites a lock it did not write."""
    lock = node.job_key("lock")
    plant_type(redis_server, lock, kind)
    for _ in range(2):
        replies = await node.round()
        assert not replies["job"].held and "not a lock value" in (replies["job"].error or "")
        assert replies["other"].held
        shown = {job["name"]: job for job in (await node.cluster())["jobs"]}
        assert shown["job"]["leader"] is None
    await node.cli("status")
    assert redis_type(redis_server, lock) == kind
    assert len(warned(caplog, READ_ONCE, lock)) == 1
    with redis_server.client() as client:
        client.delete(lock)
    assert (await node.round())["job"].held


ODD_FENCES = {
    **{name: value for name, value in ODD_VALUES.items() if value != "7"},  # a token
    "19-digits": "9" * 19,  # a token + 1 past 2^63 - 1: every term's value was foreign
    "hash": {"odd": "1"},
    "list": ["odd"],
}


@param_values(ODD_FENCES)
async def test_an_odd_fence_is_replaced_by_the_next_term(
    node: Node, redis_server: RedisServer, odd: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A fence key that holds no token this library writes reads as none when a term starts:
    the token is the server time in µs, and the fence is replaced. Before, ``nan``, ``inf``,
    a 5,000-digit or a 19-digit number made every new term's lock value foreign (the job
    never had a leader again), and a fence of another type failed every round."""
    fence, lock = node.job_key("fence"), node.job_key("lock")
    with redis_server.client() as client:
        client.delete(lock)
    plant(redis_server, fence, odd)
    before_us = int(datetime.now(UTC).timestamp() * 1_000_000)
    replies = await node.round()
    assert replies["job"].held and replies["other"].held
    value = replies["job"].value
    assert is_lock_value(value)
    token = parse_lock_value(value)[0]
    assert token is not None and token >= before_us - 1_000_000
    with redis_server.client() as client:
        assert client.get(fence) == str(token)
    await renews_both(node)
    assert len(warned(caplog, DELETED, fence)) == 1


ODD_LAST = {
    **{name: value for name, value in ODD_VALUES.items() if value != "7"},  # an instant
    "25-digits": "9" * 25,  # past year 9999 as µs
    "hash": {"odd": "1"},
    "list": ["odd"],
}


@param_values(ODD_LAST)
async def test_an_odd_last_key_reads_as_none_and_the_next_claim_replaces_it(
    node: Node, redis_server: RedisServer, odd: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A job's ``last`` key holding something no script writes reads as no last instant:
    the view shows none and says so once; the next claim runs and replaces it. Before, a
    25- or 5,000-digit number made every claim "already run" (the job never ran again), a
    key of another type failed every claim of the batch, and the view raised for
    non-ASCII digits."""
    last = node.job_key("last")
    plant(redis_server, last, odd)
    for _ in range(2):
        shown = {job["name"]: job for job in (await node.cluster())["jobs"]}
        assert shown["job"]["last_instant"] is None
    await node.cli("status")
    value = node.values["job"]
    assert value is not None
    instant_us = int(datetime.now(UTC).timestamp()) * 1_000_000
    assert await node.store.claim("job", value, instant_us) == ClaimResult.CLAIMED
    with redis_server.client() as client:
        assert client.get(last) == f"{instant_us}:{parse_lock_value(value)[0]}"
    if odd != "":
        assert len(warned(caplog, READ_ONCE, last)) == 1


@param_values({"25-digits": "9" * 25, "hash": {"odd": "1"}, "list": ["odd"]})
async def test_a_release_replaces_an_odd_last_key(
    node: Node, redis_server: RedisServer, odd: Any
) -> None:
    """``RELEASE`` records the last instant over an odd ``last`` key; before, a key of
    another type failed the release after it had deleted the first lock (no notice, the
    other locks kept), and a huge number kept the instant from being recorded."""
    last = node.job_key("last")
    plant(redis_server, last, odd)
    instant_us = int(datetime.now(UTC).timestamp()) * 1_000_000
    values = {job: value for job, value in node.values.items() if value is not None}
    assert await node.store.release(node.owner, values, {"job": instant_us}) == 2
    with redis_server.client() as client:
        assert str(client.get(last)).startswith(f"{instant_us}:")


@pytest.mark.parametrize("kind", ["hash", "list"])
async def test_the_checkpoint_writes_of_a_lock_key_of_another_type_are_refused(
    node: Node, redis_server: RedisServer, kind: str
) -> None:
    """``RECORD_RUN`` and ``SAVE_STATE`` for a job whose lock key is of another type write
    nothing (the term does not hold it) and the other job's run in the same batch is
    recorded; before, ``WRONGTYPE`` failed the call for every job in it."""
    tokens = {job: parse_lock_value(value)[0] for job, value in node.values.items()}
    plant_type(redis_server, node.job_key("lock"), kind)
    at = datetime.now(UTC)
    runs = [
        FinishedRun(job, token, "n1", Outcome.SUCCESS, at, None, 60.0)
        for job, token in tokens.items()
        if token is not None
    ]
    recorded = await node.store.record_runs(runs)  # one call for both jobs
    iterations = dict(zip(tokens, recorded.iterations, strict=True))
    assert iterations == {"job": None, "other": 1}
    token = tokens["job"]
    assert token is not None
    assert not await node.store.save_state(StateSave("job", token, "n1", "1", 60.0))


# -- all at once, on a running node ---------------------------------------------------------

HEARTBEAT_S, EXPIRY_S = 0.1, 0.6


def counted_rounds(jobs: SingletonJobs) -> tuple[list[float], list[Exception]]:
    """From now on, when each election call of ``jobs`` was sent, and what the failed ones
    raised (a call cancelled by the shutdown is no failure)."""
    engine = jobs.engine
    assert engine is not None
    elect = engine.store.elect
    sent: list[float] = []
    failed: list[Exception] = []

    async def counting(node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        sent.append(time.monotonic())
        try:
            return await elect(node_id, requests)
        except Exception as exc:
            failed.append(exc)
            raise

    engine.store.elect = counting  # type: ignore[method-assign]
    return sent, failed


async def test_odd_values_in_every_shared_key_leave_a_running_node_running(
    redis_server: RedisServer,
    redis_url: str,
    unique_project: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One odd value in every shared key at once, under a running node (the chaos row of
    docs/reliability.md): no round fails, the jobs run on (a per-second cron job claims on
    over a ``last`` key past year 9999), every odd entry the scripts own is gone within a few
    rounds, the view, readiness and the CLI answer, and no WARNING is said twice."""
    p = unique_project
    runs: list[tuple[str, float]] = []
    jobs = SingletonJobs(
        redis_url, project=p, node_id="n1", heartbeat_interval=HEARTBEAT_S, lock_expiry=EXPIRY_S
    )
    for name, schedule in (("tick", "cron"), ("other", "rate"), ("blocked", "rate")):

        async def run(name: str = name) -> None:
            runs.append((name, time.monotonic()))

        if schedule == "cron":
            jobs.cron(name, "* * * * * *")(run)
        else:
            jobs.fixed_rate(name, every=0.1, checkpoint=name == "other")(run)
    app = FastAPI()
    app.include_router(jobs.router)

    def key(name: _keys.ProjectKey) -> str:
        return _keys.project_key(p, name)

    def job_key(job: str, kind: _keys.JobKey) -> str:
        return _keys.job_key(p, job, kind)

    async with jobs:
        elector = jobs.engine.elector  # type: ignore[union-attr]
        await wait_until(lambda: all(map(elector.is_leader, ("tick", "other", "blocked"))), 5.0)
        await wait_until(lambda: any(job == "tick" for job, _ in runs), 2.0, "a tick")
        sent, failed = counted_rounds(jobs)
        owner = elector.owner
        caplog.clear()
        with redis_server.client() as client:
            pipe = client.pipeline(transaction=True)  # no round sees half of it
            pipe.hset(key("nodes:placement"), f"odd#{p}", "\u00b2|0123456789abcdef")
            pipe.hset(key("nodes:placement"), f"ghost#{p}", f"1|{'0' * 16}")
            pipe.hset(key("nodes:placement"), "#epoch", "nan")
            pipe.hset(key("nodes"), owner, "[1, 2]")
            pipe.hset(key("nodes"), f"orphan#{p}", record_json(f"orphan#{p}"))
            pipe.hset(key("nodes"), f"never#{p}", record_json(f"never#{p}"))
            pipe.zadd(key("nodes:expiry"), {f"never#{p}": float("inf")})
            pipe.hset(key("controls"), "\u0661\u0662", "1")
            pipe.set(job_key("tick", "last"), "9" * 25)
            pipe.hset(job_key("other", "checkpoint"), "iteration", "nan")
            pipe.delete(job_key("blocked", "lock"))
            pipe.hset(job_key("blocked", "lock"), "odd", "1")
            pipe.set(job_key("blocked", "fence"), "9" * 5000)
            pipe.execute()
        planted = time.monotonic()

        def owned_gone() -> bool:
            with redis_server.client() as client:
                placement = client.hgetall(key("nodes:placement"))
                return (
                    set(placement) == {"#epoch", owner}
                    and placement["#epoch"].isdigit()
                    and client.hget(key("nodes"), owner) == json_of(jobs)
                    and set(client.hkeys(key("nodes"))) == {owner}
                    and client.zrange(key("nodes:expiry"), 0, -1) == [owner]
                )

        gone = await wait_until(owned_gone, 2.0, "the odd membership entries deleted")
        rounds = sum(1 for at in sent if at <= gone)
        await wait_until(lambda: not elector.is_leader("blocked"), 2.0, "blocked let go")
        await asyncio.sleep(2.2)  # two more ticks
        ticks = [at for job, at in runs if job == "tick" and at > planted]
        with redis_server.client() as client:
            last = str(client.get(job_key("tick", "last")))
            iteration = client.hget(job_key("other", "checkpoint"), "iteration")
            client.delete(job_key("blocked", "lock"))  # the foreign lock goes
        await wait_until(lambda: elector.is_leader("blocked"), 2.0, "blocked led again")
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            codes = [(await client.get(path)).status_code for path in ("/cluster",) * 3]
            codes.append((await client.get("/health")).status_code)
        out = io.StringIO()
        argv = ["--redis-url", redis_url, "--project", p, "status"]
        assert await asyncio.to_thread(main, argv, out) == EXIT_OK, out.getvalue()
        with redis_server.client() as client:
            fence = str(client.get(job_key("blocked", "fence")))
    assert failed == []
    assert rounds <= 3, f"{rounds} rounds ({gone - planted:.3f} s) to delete them"
    instant_us = last_us(last)  # the claims replaced it
    assert len(ticks) >= 2 and instant_us is not None
    assert abs(instant_us / 1e6 - time.time()) < 5
    assert iteration is not None and iteration.isdigit()
    assert not any(job == "blocked" and planted + 0.3 < at < planted + 2 for job, at in runs)
    assert codes == [200, 200, 200, 200]
    assert is_lock_value(f"{fence}|x")
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == len(set(said)), said  # nothing said twice
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    print(
        f"deleted after {rounds} rounds ({gone - planted:.3f} s); {len(said)} warnings: "
        + "; ".join(m[:90] for m in said)
    )


def json_of(jobs: SingletonJobs) -> str:
    """The membership record ``jobs``'s running engine announces."""
    engine = jobs.engine
    assert engine is not None and engine.store.membership is not None
    return engine.store.membership.record.to_json()
