"""The example service: six singleton jobs with FastAPI dependencies, and the status router.

- ``python -m example_app`` (``__main__.py``) or ``uvicorn example_app.main:app`` serves it;
- ``python -m example_app.demo`` (``demo.py``) runs a local Redis and three replicas of it,
  and shows live the jobs spreading over them, a pause from the CLI and the handovers
  (``cluster.py`` starts the processes, ``viewer.py`` polls them, ``screen.py`` draws).

Importing this package builds nothing: the app lives in :mod:`example_app.main`.
"""
