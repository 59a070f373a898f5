"""Rendering decisions and backends for people. Nothing here decides: it prints Decision values."""

from __future__ import annotations

from dispatch.backend import Backend
from dispatch.decision import Decision
from dispatch.dispatcher import Dispatcher


def decision_text(decision: Decision, dispatcher: Dispatcher) -> str:
    document = dispatcher.document
    lines = [f"{decision.op.value} for {decision.key}"]
    if not decision.availability_checked:
        lines.append("  what-if: availability on this machine was not checked for this key")
    where = f" ({decision.rule_at})" if decision.rule_at else ""
    lines += [
        f"  chosen:   {decision.backend}",
        f"  layout:   {decision.layout.value}: {decision.layout.describe()}",
        f"  by:       {decision.chosen_by}{where}",
        f"  plugin:   {decision.plugin} (distribution {decision.impl.distribution} "
        f"{decision.impl.plugin_version or '-'}; library version {decision.impl.version or '-'})",
        f"  cluster:  {decision.cluster or 'none'}",
        *_here(decision),
        f"  registry: {document.path} (fingerprint {decision.registry_fingerprint})",
    ]
    if decision.rejected:
        width = max(len(r.backend) for r in decision.rejected)
        lines.append("  rejected:")
        lines += [f"    {r.backend.ljust(width)}  {r.reason}" for r in decision.rejected]
    return "\n".join(lines)


def _here(decision: Decision) -> list[str]:
    """In a what-if, whether the chosen backend could run on this machine, and why not."""
    if decision.availability_checked:
        return []
    availability = decision.impl.availability()
    return [f"  here:     {'available on this machine' if availability.ok else 'not available on this machine: ' + availability.reason}"]


def backend_row(backend: Backend) -> dict:
    availability = backend.availability()
    return {
        "name": backend.name,
        "op": backend.op.value,
        "layout": backend.layout.value,
        "plugin": backend.plugin,
        "distribution": backend.distribution,
        "plugin_version": backend.plugin_version,
        "version": backend.version,
        "supports": backend.supports.as_dict(),
        "available": availability.ok,
        "reason": availability.reason,
        "description": backend.description,
    }


def backends_text(rows: list[dict]) -> str:
    out = []
    for row in rows:
        s = row["supports"]
        next_n = f"{s['next_n']['min']}..{s['next_n']['max'] or ''}"
        here = "available here" if row["available"] else f"NOT available here: {row['reason']}"
        out += [
            f"{row['name']}  [{row['op']}, {row['layout']}]",
            f"  plugin {row['plugin']} (distribution {row['distribution']} {row['plugin_version'] or '-'}), "
            f"library version {row['version'] or '-'}",
            f"  supports arch {', '.join(s['archs'])}; modes {', '.join(s['forward_modes'])}; "
            f"next_n {next_n}; fp8 {', '.join(s['fp8_dtypes'])}",
            f"  {here}",
        ]
        if row["description"]:
            out.append(f"  {row['description']}")
    return "\n".join(out)
