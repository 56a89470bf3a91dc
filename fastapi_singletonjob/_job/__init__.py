"""A job as registered: its options, its schedule, its context and its parameters (FastAPI
dependencies).
"""
