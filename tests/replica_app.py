"""One replica of a FastAPI service for real-process tests: ``uvicorn replica_app:app``.

Configured entirely from the environment, like a deployed service: the library itself reads
``SINGLETONJOB_REDIS_URL``, ``SINGLETONJOB_PROJECT``, ``SINGLETONJOB_HEARTBEAT_INTERVAL``,
``SINGLETONJOB_LOCK_EXPIRY``, ``SINGLETONJOB_MAX_BACKOFF`` and the other ``SINGLETONJOB_*``
settings. Run it with ``tests/`` as the working directory or on ``PYTHONPATH``::

    SINGLETONJOB_REDIS_URL=redis://127.0.0.1:6379/0 SINGLETONJOB_PROJECT=demo \\
        python -m uvicorn replica_app:app --port 8000

One fixed-rate job (every 50 ms) takes a ``Depends`` parameter, the application's own
:class:`Ledger`; ``GET /ledger`` shows what the job wrote into it in this process, and the
library's status router is mounted under ``/sj``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI

from fastapi_singletonjob import JobContext, SingletonJobs

__all__ = ["EVERY_S", "JOB", "Ledger", "app", "get_ledger", "jobs"]

JOB = "tick"
EVERY_S = 0.05


@dataclass
class Ledger:
    """What the job did in this process: the application state it reaches through Depends."""

    runs: int = 0
    last_token: int | None = None
    last_node: str | None = None


_LEDGER = Ledger()

# The application owns logging (the library never configures it); uvicorn configures only its
# own loggers, so send the library's lines to stderr too, where the tests read them.
_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
_library_logger = logging.getLogger("fastapi_singletonjob")
_library_logger.addHandler(_handler)
_library_logger.setLevel(logging.INFO)


def get_ledger() -> Ledger:
    """The dependency the job declares: this process's ledger."""
    return _LEDGER


jobs = SingletonJobs()
"""Every setting comes from the ``SINGLETONJOB_*`` environment variables."""


@jobs.fixed_rate(JOB, every=EVERY_S)
async def tick(ctx: JobContext, ledger: Annotated[Ledger, Depends(get_ledger)]) -> None:
    """Record the run in the ledger, with the term it ran under."""
    ledger.runs += 1
    ledger.last_token = ctx.fencing_token
    ledger.last_node = ctx.node_id


app = FastAPI(title="singletonjob replica", lifespan=jobs.lifespan)
app.include_router(jobs.router, prefix="/sj")


@app.get("/ledger")
def ledger(ledger: Annotated[Ledger, Depends(get_ledger)]) -> dict[str, object]:
    """This process's runs of the job, its node id and pid."""
    return {
        "node_id": jobs.node_id,
        "pid": os.getpid(),
        "runs": ledger.runs,
        "last_token": ledger.last_token,
        "last_node": ledger.last_node,
    }
