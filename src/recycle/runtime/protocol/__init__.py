"""What crosses process boundaries: the authenticated job store, its typed channels and records, and the point-to-point
messages a plan implies."""
