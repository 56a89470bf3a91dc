"""Leader election: the leases as this node sees them, their terms, the placement of jobs over the
nodes, and the loop that keeps them.
"""
