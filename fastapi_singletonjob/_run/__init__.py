"""Running jobs: the timer that fires each job's instants, the runner that starts and records each
run, and the invocation of the user's function.
"""
