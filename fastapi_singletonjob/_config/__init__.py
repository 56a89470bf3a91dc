"""Settings and the forms of the Redis URL: what a user configures, checked and shown without a
secret.
"""
