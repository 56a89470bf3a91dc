"""Soak runs: one scenario on real servers many times over, with the distribution of what it
measured (``nox -s soak``; not part of the default suite). See ``docs/reliability.md``."""
