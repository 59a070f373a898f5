"""Implementations of the indexer ops. Each subpackage is a plugin registering through the same hook."""
