"""The store: the one interface the election, the runs and the operators need of a backend, its
data types and keys, and the in-process implementation; Redis in ``redis``.
"""
