"""`python -m dispatch bench ...` with the paged logits forced to write their -inf tail
(clean_logits=True) inside the indexer step and its lone logits stage: the A/B of the step's
clean_logits=False (docs/internal/benchmark-history.md, "The whole indexer step").

    PYTHONPATH=. python3 tools/step_with_tail.py bench --op step --batch-sizes 128 --lengths 32768 \
        --next-n 1,4 --backends triton,deepgemm.sm90,deepgemm.sm90.flatten --repeats 20
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dispatch.bench.step as step_bench  # noqa: E402
import dispatch.engines.indexer_step as indexer  # noqa: E402
from dispatch.cli.commands import main  # noqa: E402

without_tail = indexer.paged_mqa_logits


def with_tail(*args, **kwargs):
    return without_tail(*args, **{**kwargs, "clean_logits": True})


if __name__ == "__main__":
    indexer.paged_mqa_logits = with_tail
    step_bench.paged_mqa_logits = with_tail
    print("paged logits forced to clean_logits=True", flush=True)
    sys.exit(main(sys.argv[1:]))
