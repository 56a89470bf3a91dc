"""What a new leader does about the runs that no node made, decided from the stored
checkpoint: a cron or custom job's missed instants (``misfire="skip" | "run_once" |
"catch_up"``), and an interval job's spacing from the previous leader's last run. The runs
themselves go through ``JobRunner.attempt``, so each instant is claimed in the store first and
none runs twice."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from .._outcomes import DropReason
from .._schedule import count_instants, latest_instant

if TYPE_CHECKING:
    from .._checkpoint import Checkpoint
    from .runner import JobRunner

__all__ = ["catch_up", "put_off"]

logger = logging.getLogger("fastapi_singletonjob.runner")


async def catch_up(runner: JobRunner, token: int, missed: datetime | None) -> None:
    """The task of ``JobRunner.catch_up`` for term ``token``: run the missed instants the
    job's policy asks for, one after the other, while the term lasts."""
    assert runner.progress is not None
    job, schedule = runner.spec.name, runner.spec.schedule
    try:
        try:
            checkpoint = await runner.progress.load(token, runner.time_left())
        except Exception as exc:
            logger.warning(
                "job %r: node %s could not read its checkpoint (%r); instants missed "
                "before this term are not run",
                job,
                runner.node,
                exc,
            )
            return
        last = checkpoint.last_scheduled_at if checkpoint is not None else None
        now = runner.clock.now()
        if last is None or runner.spec.misfire == "run_once":
            instant = missed if last is None else latest_instant(schedule, last, now)
            if instant is not None and runner.within_grace(instant, now):
                await runner.attempt(token, instant, now, claim=True)
            elif instant is not None:
                runner.drop(DropReason.LATE)
            return
        assert runner.spec.misfire_grace_s is not None  # catch_up requires it
        grace = timedelta(seconds=runner.spec.misfire_grace_s)
        cursor = last  # the instants after it are run in order, each once
        if now - grace > last:
            oldest = schedule.next_fire(last)
            if oldest is not None and oldest < now - grace:
                runner.drop(DropReason.LATE, count_instants(schedule, oldest, now - grace, 10**4))
            cursor = now - grace
        while not runner.closed and runner.is_leader_of(token):
            instant, now = schedule.next_fire(cursor), runner.clock.now()
            if instant is None or instant > now or instant <= cursor:
                return
            if now - instant > grace:
                runner.drop(DropReason.LATE)
            else:
                await runner.attempt(token, instant, now, claim=True)
            cursor = instant
    finally:
        runner.ended()


def put_off(runner: JobRunner, checkpoint: Checkpoint | None) -> bool:
    """Whether an interval job's first run of a term must wait, because the stored last run
    (on any node) ended less than ``every`` ago; if so, sets ``runner.resume_in_s``."""
    every_s = runner.policy.period_s
    if checkpoint is None or checkpoint.last_completed_at is None or every_s is None:
        return False
    since_s = (runner.clock.now() - checkpoint.last_completed_at).total_seconds()
    if since_s >= every_s:
        return False
    runner.resume_in_s = every_s - since_s
    logger.info(
        "job %r: its last run ended %.3fs ago; node %s runs it in %.3fs",
        runner.spec.name,
        since_s,
        runner.node,
        runner.resume_in_s,
    )
    return True
