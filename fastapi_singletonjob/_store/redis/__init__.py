"""The Redis store: one store class (``store``) on a topology (``topology``: a single server,
``server``, reached directly or through ``sentinel``; or a Redis Cluster, ``cluster``),
composed of one helper per operation family (``claims``, ``checkpoints``, ``controls``, the
release ``subscription``), with the Lua ``scripts``, the coalescing ``batch``er and the
connection options (``connect``).
"""
