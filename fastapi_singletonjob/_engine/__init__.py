"""The engine: everything one ``SingletonJobs`` runs, wired, started and stopped in one place, and
its read-only snapshot.
"""
