"""Benchmarks of fastapi-singletonjob against its peers: ``python -m bench [--quick]``.

One module per family (``precision``, ``failover``, ``redis_cost``, ``overhead``, ``scale``),
each with ``run(quick, workdir) -> dict``; ``__main__`` runs them into ``bench/results.json``
and ``report`` renders ``docs/benchmarks.md`` from that file alone.
"""
