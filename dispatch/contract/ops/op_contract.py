"""What one op promises, in the form its own file declares it: the op, its run's call convention (a
Protocol), the layouts a backend of it may consume, and which steps of the indexer run it, in order."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from dispatch.contract.key import Op
from dispatch.contract.layout import Layout

PAGED_STEP = "paged"  # decode, target_verify, draft_extend: the paged cache scored in place
EXTEND_STEP = "extend"  # extend: keys gathered into one buffer and scored ragged


@dataclass(frozen=True)
class OpContract:
    """What a backend of one op promises: its run's call convention and the layouts it may consume.
    `steps` names the indexer steps that run the op and `stage` its place in them (Q quant 0, logits 1,
    top-k 2): a plan decides exactly the ops of its step, in stage order."""

    run: type
    layouts: tuple[Layout, ...]
    summary: str
    name: str  # the op's one spelling: `Op` is built from these (dispatch/contract/key.py reads them)
    steps: tuple[str, ...] = ()
    stage: int = 0

    @property
    def op(self) -> Op:
        return Op(self.name)

    def call_problem(self, run) -> str | None:
        """Why `run` cannot be called as this op's call calls it (the Protocol's parameters, positional
        ones by position, keyword-only ones by name), or None. The host asks at registration, so the
        Protocol is the one place a backend's signature is written and a mismatch names the plugin
        instead of failing on the first batch. A callable whose signature cannot be read passes, and so
        does a C function (`inspect.isbuiltin`: its signature is whatever its docstring declares)."""
        if inspect.isbuiltin(run):
            return None
        try:
            accepts = inspect.signature(run)
        except (TypeError, ValueError):
            return None
        expected = list(inspect.signature(self.run.__call__).parameters.values())[1:]  # less self
        positional = [p.name for p in expected if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        keywords = {p.name: None for p in expected if p.kind is inspect.Parameter.KEYWORD_ONLY}
        try:
            accepts.bind(*positional, **keywords)
        except TypeError as error:
            return (f"a run{accepts} that cannot take {self.name}'s call ({', '.join(positional)}, "
                    f"*, {', '.join(keywords)}; dispatch.contract.{self.run.__name__}): {error}")
        return None
