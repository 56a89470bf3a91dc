"""The HTTP side: the status router and its status page, the health probes, the admin router
and their response models.
"""
