"""The chaos replica as a module-level ASGI application, for servers that import ``module:app``
(gunicorn, hypercorn, ``uvicorn --workers`` and ``--reload``): ``CHAOS_REPLICA_CONFIG=n.json
gunicorn -k uvicorn_worker.UvicornWorker chaos.server_app:app``. Every worker builds its own
from the same config (with ``extra["generated_node_id"]``, each draws a node id of its own);
under ``gunicorn --preload`` the master builds it once, before forking the workers."""

from __future__ import annotations

from .replica import create_app

__all__ = ["app"]

app = create_app()
