"""What one op promises, in the form its own file declares it: the op, its run's call convention (a
Protocol), the layouts a backend of it may consume, and which steps of the indexer run it, in order."""

from __future__ import annotations

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
