"""The HTTP side: the status router, the health probes, the admin router and their response
models.
"""
