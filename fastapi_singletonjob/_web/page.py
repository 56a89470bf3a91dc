"""The status page (``GET {prefix}/ui`` and ``/ui/jobs/{name}``): the cluster view and each
job's history as one server-rendered HTML page, for a person rather than a program.

Built here with the standard library alone (``html.escape`` and string joins; no template
engine, no JavaScript, no file fetched from anywhere: it works offline and under a
``Content-Security-Policy`` that forbids every script). Every text that comes from Redis
(job and node names, schedules, errors) is escaped where it is written into the page, and the
page shows nothing the JSON routes do not: no store URL but the redacted one, no checkpoint
state, errors only as short as the history keeps them.

``read_page`` gathers what a page shows (one cluster read, one history read per job, bounded in
time); ``overview``, ``job_page`` and ``not_found`` turn it into HTML, as pure functions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from typing import Final
from urllib.parse import quote

from .._aio import within
from .._store.base import STORE_ERRORS
from .models import ClusterJob, ClusterNode, ClusterStatus, HistoryEntry, JobStatus
from .source import StatusSource
from .views import node_status

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "PAGE_READ_S",
    "STRIP_ENTRIES",
    "PageData",
    "PageJob",
    "job_page",
    "not_found",
    "overdue_since",
    "overview",
    "read_page",
]

PAGE_READ_S: Final = 1.0
"""Longest the page waits for each of its reads from Redis (the cluster, each history)."""
STRIP_ENTRIES: Final = 30
"""Occurrences in each job's strip on the overview (its detail view shows up to 100)."""
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
"""Sent with every page: no script, no fetch, no frame; only the page's own inline style."""


def overdue_since(job: ClusterJob | None, local: JobStatus | None) -> datetime | None:
    """Since when the job is overdue, as the page shows it: the one place the page reads it.

    The open spell as stored in Redis (the same from every replica), or, when Redis did not
    answer the cluster read, this node's last check of it; None when it is on time.
    """
    if job is not None:
        return job.overdue_since
    return local.overdue_since if local is not None else None


# -- what a page shows ----------------------------------------------------------------------


@dataclass(slots=True)
class PageJob:
    """One job as the page shows it: the cluster's view, this node's, and its history."""

    name: str
    cluster: ClusterJob | None
    """As stored in Redis; None when Redis did not answer."""
    local: JobStatus | None
    """As this node sees it; None for a job only other nodes registered."""
    history: list[HistoryEntry] | None = None
    """Newest first; None when not read (not registered here, or Redis did not answer)."""
    history_note: str | None = None
    """Why there is no history to show, when there is none."""
    overdue: datetime | None = None
    """Since when it is overdue (``overdue_since``); None when it is on time."""


@dataclass(slots=True)
class PageData:
    """Everything one page shows."""

    project: str
    node_id: str
    store: str
    """The store's redacted description."""
    observed_at: datetime
    """Redis's time of the cluster read, else this node's."""
    nodes: list[ClusterNode] | None
    jobs: list[PageJob] = field(default_factory=list)
    store_error: str | None = None
    """The exception type's name when Redis did not answer the cluster read."""
    known: list[str] = field(default_factory=list)
    """Every job's name, registered here or in the cluster view (``jobs`` may hold one)."""


async def read_page(source: StatusSource, *, only: str | None = None, limit: int) -> PageData:
    """What the page shows of every job (with ``only``, of that job alone, which may be one
    that only other nodes registered): the cluster read and, together, each job's last
    ``limit`` occurrences, each read bounded by ``PAGE_READ_S``."""
    local = {status.name: status for status in node_status(source).jobs}
    store_error = None
    cluster: ClusterStatus | None = None
    try:
        cluster = await within(source.cluster_status(), PAGE_READ_S)
    except STORE_ERRORS as exc:
        store_error = type(exc).__name__
    stored = {job.name: job for job in cluster.jobs} if cluster is not None else {}
    known = [*local, *sorted(set(stored) - set(local))]
    names = known if only is None else [name for name in known if name == only]
    jobs = [PageJob(name, stored.get(name), local.get(name)) for name in names]
    if store_error is None:
        await asyncio.gather(*(_read_history(source, job, limit) for job in jobs))
    else:  # another wait for an answer that is not coming would only delay the page
        for job in jobs:
            job.history_note = f"Redis did not answer ({store_error})"
    for job in jobs:
        job.overdue = overdue_since(job.cluster, job.local)
    return PageData(
        project=source.settings.project,
        node_id=source.settings.node_id,
        store=source.store_description,
        # Without Redis's time, this node's wall clock: only for showing "3 s ago".
        observed_at=cluster.observed_at if cluster is not None else datetime.now(UTC),
        nodes=cluster.nodes if cluster is not None else None,
        jobs=jobs,
        store_error=store_error,
        known=known,
    )


async def _read_history(source: StatusSource, job: PageJob, limit: int) -> None:
    spec = source.jobs.get(job.name)
    if spec is None:
        job.history_note = "registered on other nodes: their history routes serve it"
        return
    kept = spec.history if spec.history is not None else source.settings.history
    if not spec.checkpoint or kept == 0:
        job.history_note = "no history kept (history=0 or checkpoint=False)"
        return
    try:
        entries = await within(source.history(job.name, limit), PAGE_READ_S)
    except STORE_ERRORS as exc:
        job.history_note = f"Redis did not answer ({type(exc).__name__})"
        return
    job.history = [HistoryEntry.of(entry) for entry in entries]


# -- HTML -----------------------------------------------------------------------------------


def overview(data: PageData, *, refresh_s: int) -> str:
    """The page of every job (``GET {prefix}/ui``); links are relative to it."""
    cards = "".join(
        _card(job, data.observed_at, link=f"ui/jobs/{_path(job.name)}") for job in data.jobs
    )
    body = (
        _header(data, title=f"singletonjob · {data.project}", refresh_s=refresh_s, here="ui")
        + _nodes(data)
        + f'<main class="jobs">{cards or "<p>No jobs are registered.</p>"}</main>'
        + _LEGEND
    )
    return _document(f"singletonjob · {data.project}", body, refresh_s)


def job_page(data: PageData, *, refresh_s: int) -> str:
    """One job's page (``GET {prefix}/ui/jobs/{name}``): its card and every occurrence read."""
    (job,) = data.jobs
    here = _path(job.name)
    rows = "".join(_entry(entry, data.observed_at) for entry in job.history or [])
    if job.history is None:
        listing = f'<p class="note">{_e(job.history_note or "no history")}</p>'
    elif not rows:
        listing = '<p class="note">Nothing recorded yet.</p>'
    else:
        listing = f'<ol class="entries">{rows}</ol>'
    body = (
        _header(data, title=job.name, refresh_s=refresh_s, here=here, back="../../ui")
        + f'<main class="one">{_card(job, data.observed_at, link=None)}'
        + f"<section><h2>Occurrences, newest first</h2>{listing}</section></main>"
        + _LEGEND
    )
    return _document(f"{job.name} · singletonjob · {data.project}", body, refresh_s)


def not_found(name: str, known: Iterable[str]) -> str:
    """The page for a job nobody registered (served with 404)."""
    names = ", ".join(_e(n) for n in sorted(known)) or "none"
    body = (
        '<header><p><a href="../../ui">← all jobs</a></p>'
        f"<h1>No job named {_e(repr(name))}</h1></header>"
        f"<main><p>Known jobs: {names}.</p></main>"
    )
    return _document("no such job · singletonjob", body, 0)


def _document(title: str, body: str, refresh_s: int) -> str:
    refresh = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s > 0 else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'{refresh}<meta name="robots" content="noindex"><title>{_e(title)}</title>'
        f"<style>{_CSS}</style></head><body>{body}</body></html>"
    )


def _header(
    data: PageData, *, title: str, refresh_s: int, here: str, back: str | None = None
) -> str:
    at = _time(data.observed_at, data.observed_at)
    clock = "Redis time" if data.store_error is None else "this node's time"
    refresh = (
        f'refreshes every {refresh_s} s · <a href="{here}?refresh=0">stop</a>'
        if refresh_s > 0
        else f'not refreshing · <a href="{here}">refresh every 10 s</a>'
    )
    up = f'<p><a href="{back}">← all jobs</a></p>' if back else ""
    banner = (
        f'<p class="banner" role="alert">Redis did not answer ({_e(data.store_error)}): '
        "this node's own view only, no leaders, pauses or history.</p>"
        if data.store_error
        else ""
    )
    return (
        f"<header>{up}<h1>{_e(title)}</h1>"
        f'<p class="meta">project <b>{_e(data.project)}</b> · {clock} {at} · served by '
        f"<b>{_e(data.node_id)}</b> · {_e(data.store)} · {refresh}</p>{banner}</header>"
    )


def _nodes(data: PageData) -> str:
    if data.nodes is None:
        return ""
    items = "".join(
        f'<li><b>{_e(node.node_id)}</b> <span class="dim">v{_e(node.version)}, seen '
        f"{_ago(node.last_seen, data.observed_at)}</span>"
        + (f" · leads {_e(', '.join(node.leads))}" if node.leads else "")
        + "</li>"
        for node in data.nodes
    )
    count = len(data.nodes)
    return (
        f'<section class="nodes"><h2>{count} live node{"" if count == 1 else "s"}</h2>'
        f"<ul>{items or '<li>none</li>'}</ul></section>"
    )


def _card(job: PageJob, now: datetime, *, link: str | None) -> str:
    stored, local = job.cluster, job.local
    badges = []
    if local is not None and not local.enabled:
        badges.append('<span class="badge off">disabled</span>')
    if stored is not None and stored.paused:
        badges.append('<span class="badge paused">paused</span>')
    if job.overdue is not None:
        late = _span(max(0.0, (now - job.overdue).total_seconds()))
        badges.append(f'<span class="badge overdue">overdue {late}</span>')
    if stored is not None and stored.leader is None and (local is None or local.enabled):
        badges.append('<span class="badge none">no leader</span>')
    name = f'<a href="{link}">{_e(job.name)}</a>' if link else _e(job.name)
    schedule = (stored.schedule if stored else None) or (local.schedule if local else "")
    rows = [
        ("Leader", _leader(stored)),
        ("Paused", _paused(stored, now)),
        ("Next run", _next_run(local, now)),
        ("Overdue", _overdue(job.overdue, now)),
        ("Last run", _last_run(job, now)),
    ]
    checkpoint = stored.checkpoint if stored is not None else None
    if checkpoint is not None:
        cluster_wide = f'{checkpoint.iteration} <span class="dim">(cluster)</span>'
        rows.append(("Successful runs", cluster_wide))
    failure = _last_failure(job.history, now)
    missed = _last_missed(job.history, now)
    if failure:
        rows.append(("Last failure", failure))
    if missed:
        rows.append(("Last not run", missed))
    cells = "".join(f"<dt>{label}</dt><dd>{value}</dd>" for label, value in rows)
    return (
        f'<article class="job" id="job-{_e(job.name)}" data-job="{_e(job.name)}">'
        f"<h2>{name} {''.join(badges)}</h2>"
        f'<p class="schedule">{_e(schedule)}</p><dl>{cells}</dl>{_strip(job, now)}</article>'
    )


def _leader(stored: ClusterJob | None) -> str:
    if stored is None:
        return '<span class="dim">unknown</span>'
    if stored.leader is None:
        return '<span class="dim">none</span>'
    token = "" if stored.fencing_token is None else f"fencing token {stored.fencing_token}"
    left = stored.lease_time_left_s
    lease = "" if left is None else f" · lease {_span(left)} left"
    return f'<span title="{token}">{_e(stored.leader)}</span><span class="dim">{lease}</span>'


def _paused(stored: ClusterJob | None, now: datetime) -> str:
    if stored is None:
        return '<span class="dim">unknown</span>'
    if not stored.paused:
        return "no"
    return "yes" + (f", since {_time(stored.paused_at, now)}" if stored.paused_at else "")


def _next_run(local: JobStatus | None, now: datetime) -> str:
    if local is None or local.next_run is None:
        return '<span class="dim">—</span>'
    return f'{_time(local.next_run, now)} <span class="dim">({_ago(local.next_run, now)})</span>'


def _overdue(overdue: datetime | None, now: datetime) -> str:
    if overdue is None:
        return "no"
    return f'<b class="bad">since {_time(overdue, now)}</b> ({_ago(overdue, now)})'


def _last_run(job: PageJob, now: datetime) -> str:
    """The newest run in the history read, else the one the checkpoint names."""
    entry = next((e for e in job.history or [] if e.kind == "run"), None)
    if entry is not None:
        return _said(entry, now)
    checkpoint = job.cluster.checkpoint if job.cluster is not None else None
    if checkpoint is not None and checkpoint.last_scheduled_at is not None:
        outcome = checkpoint.last_outcome or "unknown"
        return (
            f"{_time(checkpoint.last_scheduled_at, now)} "
            f'<span class="o-{_e(outcome)}">{_e(outcome)}</span>'
        )
    return '<span class="dim">none recorded</span>'


def _last_missed(history: list[HistoryEntry] | None, now: datetime) -> str | None:
    entry = next((e for e in history or [] if e.kind == "missed"), None)
    if entry is None:
        return None
    return _said(entry, now) + f' <span class="dim">{_e(entry.reason_text or "")}</span>'


def _said(entry: HistoryEntry, now: datetime) -> str:
    """An entry's instant and what became of it."""
    what = f'<span class="{_class(entry)}">{_e(_what(entry))}</span>'
    return f"{_time(entry.scheduled_at, now)} {what}"


def _last_failure(history: list[HistoryEntry] | None, now: datetime) -> str | None:
    entry = next((e for e in history or [] if e.error), None)
    if entry is None:
        return None
    return f'{_time(entry.scheduled_at, now)} <code class="error">{_e(entry.error)}</code>'


def _strip(job: PageJob, now: datetime) -> str:
    if job.history is None:
        return f'<p class="note">{_e(job.history_note or "no history")}</p>'
    if not job.history:
        return '<p class="note">Nothing recorded yet.</p>'
    cells = "".join(
        f'<span class="cell {_class(entry)}" title="{_e(_title(entry, now))}"></span>'
        for entry in reversed(job.history[:STRIP_ENTRIES])
    )
    return (
        f'<div class="strip" role="img" aria-label="last {min(len(job.history), STRIP_ENTRIES)}'
        f' occurrences, oldest first">{cells}</div>'
    )


def _entry(entry: HistoryEntry, now: datetime) -> str:
    detail = entry.error or entry.reason_text or ""
    facts = [f"node {_e(entry.node_id)}", f"token {entry.fencing_token}"]
    if entry.duration_s is not None:
        facts.append(_duration(entry.duration_s))
    return (
        f'<li class="entry" title="{_e(_title(entry, now))}"><span class="cell {_class(entry)}">'
        f"</span><span>{_time(entry.scheduled_at, now, precise=True)}</span> "
        f'<b class="{_class(entry)}">'
        f'{_e(_what(entry))}</b> <span class="dim">{" · ".join(facts)}</span>'
        + (f'<div class="detail">{_e(detail)}</div>' if detail else "")
        + "</li>"
    )


def _what(entry: HistoryEntry) -> str:
    if entry.kind == "missed":
        return f"not run: {entry.reason.value if entry.reason else 'unknown'}"
    return entry.outcome.value if entry.outcome else "unknown"


def _class(entry: HistoryEntry) -> str:
    if entry.kind == "missed":
        return "o-missed"
    return f"o-{entry.outcome.value if entry.outcome else 'unknown'}"


def _title(entry: HistoryEntry, now: datetime) -> str:
    """The text on hover: everything the history keeps of the entry but the recorded time."""
    lines = [f"{_iso(entry.scheduled_at)} ({_ago(entry.scheduled_at, now)})", _what(entry)]
    if entry.reason_text:
        lines.append(entry.reason_text)
    if entry.error:
        lines.append(entry.error)
    facts = f"node {entry.node_id}, token {entry.fencing_token}"
    if entry.duration_s is not None:
        facts += f", {_duration(entry.duration_s)}"
    lines.append(facts)
    return "\n".join(lines)


# -- formatting -----------------------------------------------------------------------------


def _e(text: object) -> str:
    return escape(str(text), quote=True)


def _path(name: str) -> str:
    return quote(name, safe="")


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _time(at: datetime, now: datetime, *, precise: bool = False) -> str:
    """``at`` as a short UTC time (its date too when not ``now``'s day; with ``precise``, to
    the millisecond), the full instant on hover."""
    utc = at.astimezone(UTC)
    same_day = utc.date() == now.astimezone(UTC).date()
    shown = utc.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S")
    if precise:
        shown += f".{utc.microsecond // 1000:03d}"
    elif not same_day:
        shown = shown[:-3]
    iso = _iso(at)
    return f'<time datetime="{iso}" title="{iso}">{shown}Z</time>'


def _ago(at: datetime, now: datetime) -> str:
    seconds = (now - at).total_seconds()
    span = _span(abs(seconds))
    return f"{span} ago" if seconds >= 0 else f"in {span}"


def _span(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f}\u00a0s"
    if seconds < 120:
        return f"{seconds:.0f}\u00a0s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}\u00a0min"
    if seconds < 172_800:
        return f"{seconds / 3600:.0f}\u00a0h"
    return f"{seconds / 86400:.0f}\u00a0d"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.1f}\u00a0ms"
    return f"{seconds:.2f}\u00a0s" if seconds < 60 else _span(seconds)


_COLOURS: Mapping[str, str] = {
    "success": "#2e7d32",
    "failed": "#c62828",
    "timeout": "#ef6c00",
    "cancelled": "#6d6d6d",
}

_LEGEND = (
    '<footer class="legend">'
    + "".join(
        f'<span><span class="cell o-{outcome}"></span>{outcome}</span>' for outcome in _COLOURS
    )
    + '<span><span class="cell o-missed"></span>not run (reason on hover, or in the job\'s '
    "page)</span></footer>"
)

_CSS = (
    ":root{color-scheme:light dark;--fg:#1b1b1b;--bg:#fafafa;--card:#fff;--line:#ddd;"
    "--dim:#666;--bad:#c62828}"
    "@media (prefers-color-scheme:dark){:root{--fg:#e6e6e6;--bg:#121212;--card:#1e1e1e;"
    "--line:#333;--dim:#9a9a9a;--bad:#ef5350}}"
    "*{box-sizing:border-box}"
    "body{margin:0;padding:12px;font:15px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,"
    "sans-serif;color:var(--fg);background:var(--bg);overflow-wrap:anywhere}"
    "a{color:inherit}h1{font-size:1.3rem;margin:.2rem 0}h2{font-size:1.05rem;margin:0 0 .3rem}"
    ".meta,.dim,.schedule,.note{color:var(--dim)}.meta{margin:.2rem 0 .8rem;font-size:.85rem}"
    ".banner{background:#fff3e0;color:#5d2e00;border:1px solid #ef6c00;padding:.5rem;"
    "border-radius:6px}"
    ".nodes ul{margin:0 0 1rem;padding-left:1.2rem;font-size:.9rem}"
    ".jobs{display:grid;gap:12px;align-items:start;"
    "grid-template-columns:repeat(auto-fill,minmax(min(100%,24rem),1fr))}"
    ".job{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px 12px;"
    "min-width:0}"
    ".schedule{margin:0 0 .4rem;font-size:.85rem}"
    "dl{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:2px 10px;margin:0 0 .5rem;"
    "font-size:.9rem}dt{color:var(--dim)}dd{margin:0;min-width:0}"
    ".badge{display:inline-block;font-size:.75rem;font-weight:600;padding:1px 7px;"
    "border-radius:9px;vertical-align:middle;color:#fff}"
    ".badge.paused{background:#1565c0}.badge.overdue{background:var(--bad)}"
    ".badge.off,.badge.none{background:#6d6d6d}.bad{color:var(--bad)}"
    "code.error{color:var(--bad);font-size:.85rem;white-space:pre-wrap}"
    ".strip{display:flex;flex-wrap:wrap;gap:2px}"
    ".cell{display:inline-block;width:9px;height:20px;border-radius:2px;flex:none}"
    + "".join(
        f".o-{k}{{color:{v}}}.cell.o-{k}{{background:{v}}}"
        for k, v in {**_COLOURS, "unknown": "#9e9e9e"}.items()
    )
    + ".o-missed{color:#b26a00}.cell.o-missed{background:repeating-linear-gradient(45deg,"
    "#f9a825 0 3px,transparent 3px 6px);outline:1px solid #f9a825;outline-offset:-1px}"
    ".entries{list-style:none;padding:0;margin:0}"
    ".entry{padding:4px 0;border-bottom:1px solid var(--line);font-size:.9rem}"
    ".entry .cell{height:12px;margin-right:6px;vertical-align:baseline}"
    ".detail{margin:2px 0 0 15px;color:var(--dim);white-space:pre-wrap}"
    ".one{max-width:60rem}.one section{margin-top:1rem}"
    ".legend{margin-top:1rem;font-size:.8rem;color:var(--dim);display:flex;flex-wrap:wrap;"
    "gap:4px 12px}"
    ".legend .cell{height:12px;margin-right:4px;vertical-align:baseline}"
)
