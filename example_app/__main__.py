"""``python -m example_app``: serve the example on ``HOST`` (default 127.0.0.1) and ``PORT``
(default 8000); containers set ``HOST=0.0.0.0``.

Logging is configured here, in the application's entry point; the library never configures it.
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

import uvicorn

GRACEFUL_SHUTDOWN_S = 5
"""uvicorn's ``--timeout-graceful-shutdown``: how long shutdown waits for open requests."""


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    # uvicorn shuts down gracefully on SIGTERM (the lifespan releases the locks), then
    # re-raises the signal with the previous handler restored; without this handler the
    # process would end "killed by SIGTERM" although it stopped cleanly.
    raise SystemExit(0)


def main() -> None:
    """Configure logging and run uvicorn until SIGTERM or Ctrl-C."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    from .telemetry import setup_telemetry

    setup_telemetry()
    from .main import app  # after basicConfig, so that the app's startup lines are shown

    signal.signal(signal.SIGTERM, _exit_cleanly)
    host = os.environ.get("HOST", "127.0.0.1")
    port = int(os.environ.get("PORT", "8000"))
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_config=None,
        # Bounds the wait for open HTTP requests at shutdown, before the lifespan shutdown
        # (drain the runs, release the locks) starts; deploy/ sizes grace periods with it.
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


if __name__ == "__main__":
    main()
