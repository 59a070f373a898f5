"""`python -m dispatch bench`: check every backend available here against the reference, then time it."""
