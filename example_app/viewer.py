"""The demo's view of the cluster: who leads each job and when it last ran.

The viewer asks every replica for ``GET /singletonjob/jobs`` (each one answers for itself) and
merges the answers. A job's leader is the replica that answers that it leads the job; while no
replica does, the job counts as leaderless, even if a stopped or killed node still holds its lock
in Redis. The leaderless time of a handover is measured between two polls: from the last poll
that showed the old leader to the first that showed the new one, so it is an upper bound,
coarse by one poll interval. A handover away from the replica the demo just signalled is
attributed to that signal; any other is a placement move (leadership spreading over the
replicas), and labelled so.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .cluster import HOST, Process

Status = dict[str, Any]
LEADERLESS_GRACE_S = 0.5
"""How long no replica answers as a job's leader before the viewer says so: a graceful
handover takes milliseconds, and announcing it (with the old holder's lock time as a follower
last saw it, long since released) made the demo say "still holds the lock for 9.3s" a tenth
of a second before the handover line. A killed leader's lock does stay for seconds."""
PLACEMENT = "placement move"
"""The cause of a handover the demo did not provoke: leadership spreading over the replicas."""


def fetch_status(process: Process, timeout_s: float) -> Status | None:
    """One replica's ``GET /singletonjob/jobs``, or None when it does not answer."""
    if not process.running:
        return None
    url = f"http://{HOST}:{process.port}/singletonjob/jobs"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body: Status = json.load(response)
            return body
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class JobView:
    """What the replicas' answers say about one job at one poll."""

    name: str
    leaders: tuple[str, ...]
    """Replicas that answered that they lead the job (more than one would be a bug)."""
    holder: str | None
    """When no replica answers as leader: the lock holder that a follower last saw."""
    holder_ttl_s: float | None
    """The holder's lease time left as a follower last saw it, less the time since: a lower
    bound, since the holder may have renewed after that follower looked."""
    token: int | None
    last_run: tuple[str, str, int, str] | None
    """(node, started_at, runs on that node, outcome) of the latest run any replica reports."""
    next_run: str | None
    paused: bool = False
    """An operator paused the job, as its leader (else any replica) answers."""

    @property
    def leader(self) -> str | None:
        """The one leader, or None."""
        return self.leaders[0] if len(self.leaders) == 1 else None


def merge(statuses: dict[str, Status | None]) -> dict[str, JobView]:
    """Per job, the combined view of every replica that answered."""
    answered = {name: status for name, status in statuses.items() if status is not None}
    names: list[str] = []
    for status in answered.values():
        names.extend(job["name"] for job in status["jobs"] if job["name"] not in names)
    views = {}
    for job in names:
        rows = {
            node: next(j for j in status["jobs"] if j["name"] == job)
            for node, status in answered.items()
        }
        leaders = tuple(node for node, row in rows.items() if row["is_leader"])
        holder, ttl = None, None
        if not leaders:
            seen = [row for row in rows.values() if row["leader"] is not None]
            if seen:
                holder, ttl = seen[0]["leader"], seen[0]["lease_time_left_s"]
        token = rows[leaders[0]]["fencing_token"] if leaders else None
        runs = [
            (node, row["last_run"]["started_at"], row["runs"], row["last_run"]["outcome"])
            for node, row in rows.items()
            if row["last_run"] is not None
        ]
        leader_row = rows[leaders[0]] if leaders else next(iter(rows.values()))
        paused = (
            bool(leader_row.get("paused"))
            if leaders
            else any(row.get("paused") for row in rows.values())
        )
        views[job] = JobView(
            name=job,
            leaders=leaders,
            holder=holder,
            holder_ttl_s=ttl,
            token=token,
            last_run=max(runs, key=lambda run: instant(run[1])) if runs else None,
            next_run=leader_row["next_run"],
            paused=paused,
        )
    return views


@dataclass(frozen=True)
class Handover:
    """A job moving from one leader to another, as the viewer saw it."""

    job: str
    old: str
    new: str
    leaderless_s: float
    cause: str


@dataclass
class Tracker:
    """Follows the merged views poll after poll and reports every change."""

    poll_s: float
    cause: str = PLACEMENT
    """What the demo did last (``"graceful stop of replica-1 (SIGTERM)"``), attached to the
    handovers away from ``cause_node``."""
    cause_node: str | None = None
    """The replica the demo signalled last."""
    views: dict[str, JobView] = field(default_factory=dict)
    handovers: list[Handover] = field(default_factory=list)
    overlaps: int = 0
    _leader: dict[str, str] = field(default_factory=dict)
    """Per job, the last leader seen (kept while the job is leaderless)."""
    _seen_at: dict[str, float] = field(default_factory=dict)
    """Per job, when the last poll that showed a leader was taken."""
    _leaderless: set[str] = field(default_factory=set)
    _last_run: dict[str, tuple[str, str]] = field(default_factory=dict)
    _paused: set[str] = field(default_factory=set)

    def update(self, at: float, statuses: dict[str, Status | None]) -> list[tuple[str, str]]:
        """Take one poll (taken at monotonic time ``at``); return the changes as
        ``(kind, message)``, kind ``"leader"`` or ``"run"``. Jobs that changed leader the
        same way share one message."""
        self.views = merge(statuses)
        leadership: dict[str, list[str]] = {}
        runs: list[tuple[str, str]] = []
        for job, view in self.views.items():
            change = self._leadership(at, view)
            if change is not None:
                leadership.setdefault(change, []).append(job)
            if view.paused != (job in self._paused):
                self._paused ^= {job}
                state = "paused" if view.paused else "resumed"
                said = f"{state}, as {view.leader or 'the replicas'} answers in /singletonjob/jobs"
                leadership.setdefault(said, []).append(job)
            if view.last_run is not None:
                node, started_at, count, outcome = view.last_run
                seen = self._last_run.get(job)
                # Newer runs only: when a leader stops answering, an older run elsewhere shows.
                if seen is None or instant(started_at) > instant(seen[1]):
                    self._last_run[job] = (node, started_at)
                    runs.append(
                        ("run", f"{job} ran on {node} at {_clock(started_at)} ({outcome}, "
                                f"run {count} there)")
                    )  # fmt: skip
        changes = [("leader", f"{', '.join(jobs)}: {what}") for what, jobs in leadership.items()]
        return changes + runs

    def _leadership(self, at: float, view: JobView) -> str | None:
        """What changed about the job's leader at this poll, if anything."""
        job, previous = view.name, self._leader.get(view.name)
        if len(view.leaders) > 1:
            self.overlaps += 1
            return f"TWO LEADERS answer at once: {', '.join(view.leaders)}"
        new = view.leader
        if new is None:
            if previous is None or job in self._leaderless:
                return None
            seen_at = self._seen_at.get(job)
            if seen_at is not None and at - seen_at < LEADERLESS_GRACE_S:
                return None  # a graceful handover comes within milliseconds: wait for it
            self._leaderless.add(job)
            if view.holder is not None and view.holder_ttl_s is not None:
                return (
                    f"no replica answers as leader; {view.holder} still holds the lock, for at "
                    f"least {max(0.0, view.holder_ttl_s):.1f}s more"
                )
            return "no replica answers as leader"
        self._leaderless.discard(job)
        if new == previous:
            self._seen_at[job] = at
            return None
        self._leader[job] = new
        seen_at, self._seen_at[job] = self._seen_at.get(job), at
        if previous is None or seen_at is None:
            return f"{new} leads (fencing token {view.token})"
        cause = self.cause if previous == self.cause_node else PLACEMENT
        handover = Handover(job, previous, new, at - seen_at, cause)
        self.handovers.append(handover)
        return (
            f"handover {previous} -> {new} ({cause}), leaderless "
            f"{handover.leaderless_s:.3f}s (fencing token {view.token})"
        )

    def leaderless_for(self, job: str, now: float) -> float | None:
        """How long no replica has answered as the job's leader, or None if one does."""
        if job not in self._leaderless or job not in self._seen_at:
            return None
        return now - self._seen_at[job]

    def leader_of(self, job: str) -> str | None:
        """The job's current leader, if one answers."""
        view = self.views.get(job)
        return view.leader if view is not None else None

    def led_by(self, replica: str) -> list[str]:
        """The jobs ``replica`` leads, in the order of the jobs."""
        return [job for job, view in self.views.items() if view.leader == replica]

    def all_led(self, replicas: Sequence[str] | None = None) -> bool:
        """Every job has exactly one answering leader (among ``replicas``, if given)."""
        return bool(self.views) and all(
            view.leader is not None and (replicas is None or view.leader in replicas)
            for view in self.views.values()
        )


class Poller:
    """Asks every running replica at once; one thread per replica."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="poll")

    def poll(self, replicas: Sequence[Process]) -> dict[str, Status | None]:
        """Each replica's status (None for those that do not answer)."""
        futures = {p.name: self._pool.submit(fetch_status, p, self._timeout_s) for p in replicas}
        return {name: future.result() for name, future in futures.items()}

    def close(self) -> None:
        """Wait for requests in flight (bounded by their timeout) and stop the threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def instant(text: str) -> datetime:
    """An ISO 8601 instant, as the status routes write it."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _clock(text: str) -> str:
    """``10:12:50.500`` in local time, from an ISO 8601 instant."""
    return instant(text).astimezone().strftime("%H:%M:%S.%f")[:-3]


def ago(text: str) -> float:
    """Seconds since an ISO 8601 instant."""
    return (datetime.now(UTC) - instant(text)).total_seconds()
