"""A minimal FastAPI service with one job of each schedule shape.

Run it with ``python -m example_app`` (see ``__main__.py``) or ``uvicorn example_app.main:app``.
Importing this package builds nothing: the app lives in :mod:`example_app.main`.
"""
