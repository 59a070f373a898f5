"""registry.yaml: ordered rules per op, fallback chains and cluster overlays."""

from dispatch.registry.document import RegistryDocument, load_registry, parse_registry
from dispatch.registry.models import Cluster, OpTable, Registry, Rule, When

__all__ = ["Cluster", "OpTable", "Registry", "RegistryDocument", "Rule", "When", "load_registry", "parse_registry"]
