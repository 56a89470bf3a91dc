"""The Redis store: a single server, Sentinel and Redis Cluster, one module per operation family
(scripts, claims, checkpoints, controls, the release subscription).
"""
