"""``python -m example_app``: serve the example on 127.0.0.1 (port from ``PORT``, default 8000).

Logging is configured here, in the application's entry point; the library never configures it.
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

import uvicorn


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
    port = int(os.environ.get("PORT", "8000"))
    uvicorn.run(app, host="127.0.0.1", port=port, log_config=None)


if __name__ == "__main__":
    main()
