"""Deciding: which backend serves an op at a key. The dispatcher (rules, fallbacks, frozen decisions
with their rejections), the clusters that overlay the registry on matching machines, the GPUs known by
name, and load_dispatcher, which puts registry, plugins and cluster together. Imports the contract and
the registry only."""
