"""An engine's loop over the indexer, through dispatch: ragged, growing sequences; each request's
prompt prefilled in two extend batches (the second with the first as its cached prefix), then batches
that switch between decode, speculative verification and draft extension; several layers per step.

    python examples/engine_loop.py [--steps 7] [--layers 3] [--device cuda] [--quiet]

Each new decision is logged once on stderr (the `dispatch` logger at INFO); --quiet hides it.

Where SGLang decided the path inside the indexer with `ctx.shape == (B, next_n)` on a tensor that
another module built under its own condition, here `step.plan(batch)` decides once per batch and the
plan carries the decision; every layer's call is checked against it. Nothing looks at a shape. An
ExtendBatch gets the ragged step (keys gathered per layer, logits chunked to a byte budget); a
PagedBatch the paged one; the same plan / select pair serves both.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

import torch

from dispatch import ExtendBatch, PagedBatch, IndexerStep, RopeSpec, load_dispatcher

HEADS, HEAD_DIM, ROT_DIM = 64, 128, 64
BLOCK_KV = 64  # tokens per KV page: the engines' DSA caches and dispatch's kernels use pages of 64
# After the two extend steps, (forward mode, tokens scored per request): plain decode, MTP
# verification of 3 drafts, draft extension.
SCHEDULE = [("decode", 1), ("target_verify", 4), ("draft_extend", 2)]
EXTEND_STEPS = 2


class PagedKV:
    """A toy paged fp8 K cache per layer: pages handed out as sequences grow."""

    def __init__(self, layers: int, num_blocks: int, device: str, generator: torch.Generator) -> None:
        row = HEAD_DIM + 4
        raw = torch.randint(0, 256, (layers, num_blocks, BLOCK_KV * row), dtype=torch.uint8, generator=generator)
        values = (torch.randn(layers, num_blocks, BLOCK_KV * HEAD_DIM, generator=generator) * 50)
        raw[..., : BLOCK_KV * HEAD_DIM] = values.to(torch.float8_e4m3fn).view(torch.uint8)
        raw[..., BLOCK_KV * HEAD_DIM :] = torch.rand(layers, num_blocks, BLOCK_KV).view(torch.uint8)
        self.caches = raw.view(layers, num_blocks, BLOCK_KV, 1, row).to(device)
        self.free = list(torch.randperm(num_blocks, generator=generator).tolist())
        self.pages: list[list[int]] = []

    def grow(self, request: int, length: int) -> None:
        while len(self.pages) <= request:
            self.pages.append([])
        while len(self.pages[request]) < math.ceil(length / BLOCK_KV):
            self.pages[request].append(self.free.pop())

    def table(self, device: str) -> torch.Tensor:
        width = max(len(p) for p in self.pages)
        return torch.tensor([p + [0] * (width - len(p)) for p in self.pages], dtype=torch.int32, device=device)


def main(argv: list[str] | None = None) -> list[tuple[object, torch.Tensor]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="engine steps (batches)")
    parser.add_argument("--layers", type=int, default=3, help="indexer layers per step")
    parser.add_argument("--requests", type=int, default=4, help="requests per batch")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the tensors live (default: cuda when torch sees a GPU)")
    parser.add_argument("--quiet", action="store_true", help="do not show dispatch's decision log")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        sys.exit(f"engine_loop.py: --device cuda, but torch sees no CUDA GPU ({build}); use --device cpu")
    show_decisions(quiet=args.quiet)
    generator = torch.Generator().manual_seed(0)
    # A small logits budget so the example's extend batches run in several chunks, as long prompts do.
    step = IndexerStep(load_dispatcher(), kv_fp8_dtype=torch.float8_e4m3fn, rope=RopeSpec.neox_head(),
                       softmax_scale=HEAD_DIM**-0.5, head_scale=HEADS**-0.5, index_topk=256, logits_byte_budget=1 << 18)
    kv = PagedKV(args.layers, num_blocks=512, device=args.device, generator=generator)
    prompts = torch.randint(40, 400, (args.requests,), generator=generator).tolist()  # ragged prompts
    # Two extend steps: the prompt's first part (a one-token first part for request 0), then the rest.
    first_parts = [1] + [max(n // 3, 1) for n in prompts[1:]]
    lengths = [0] * args.requests
    cos_sin = torch.randn(4096, ROT_DIM, generator=generator).to(torch.bfloat16).to(args.device)
    selected = []
    for number in range(args.steps):
        if number < EXTEND_STEPS:
            new = first_parts if number == 0 else [p - f for p, f in zip(prompts, first_parts)]
            plan, tokens, positions = extend_plan(step, kv, lengths, new, args.device)
            lengths = [n + e for n, e in zip(lengths, new)]
        else:
            mode, next_n = SCHEDULE[(number - EXTEND_STEPS) % len(SCHEDULE)]
            lengths = [n + next_n for n in lengths]  # each request's total length L now includes this step's tokens
            plan, tokens, positions = paged_plan(step, kv, lengths, mode, next_n, args.device)
        for layer in range(args.layers):
            q = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16).to(args.device)
            weights = torch.randn(tokens, HEADS, generator=generator).to(args.device)
            selected.append((plan, step.select(plan, q, weights, positions, cos_sin, kv.caches[layer])))
    return selected


def show_decisions(*, quiet: bool) -> None:
    """dispatch logs each new decision at INFO on its `dispatch` logger and installs no handler: an
    engine attaches its own. This one prints them on stderr unless quiet."""
    logger = logging.getLogger("dispatch")
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    for handler in [h for h in logger.handlers if getattr(h, "engine_loop", False)]:
        logger.removeHandler(handler)  # a second run (a test) writes to the stderr of its own time
    handler = logging.StreamHandler(sys.stderr)
    handler.engine_loop = True
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    logger.addHandler(handler)


def extend_plan(step: IndexerStep, kv: PagedKV, cached: list[int], new: list[int], device: str):
    """An extend batch: each request's `new` prompt tokens after its `cached` ones (their keys written
    to the cache before the indexer runs)."""
    for request, (prefix, extend) in enumerate(zip(cached, new)):
        kv.grow(request, prefix + extend)
    plan = step.plan(ExtendBatch.from_lengths(cached, new, kv.table(device)))
    print(f"step: extend        {sum(new)} new tokens over {plan.total_keys} keys -> logits "
          f"{plan.ragged_logits.backend} ({plan.ragged_logits.rule}) in {len(plan.chunks)} chunks, "
          f"q quant {plan.indexer_q_quant.backend}")
    positions = torch.tensor([p + j for p, e in zip(cached, new) for j in range(e)], device=device)
    return plan, sum(new), positions


def paged_plan(step: IndexerStep, kv: PagedKV, lengths: list[int], mode: str, next_n: int, device: str):
    for request, length in enumerate(lengths):
        kv.grow(request, length)
    batch = PagedBatch(torch.tensor(lengths, dtype=torch.int32, device=device), kv.table(device),
                         max_seq_len=max(lengths), forward_mode=mode, next_n=next_n,
                         num_kv_blocks=kv.caches.shape[1])  # the pool: its page table is checked once per batch
    plan = step.plan(batch)  # once per batch: the decision, its layout's tensors, the page checks
    print(f"step: {mode:13s} next_n={next_n} -> logits {plan.logits.backend} "
          f"({plan.layout.value}, {plan.logits.rule}), q quant {plan.indexer_q_quant.backend}")
    positions = torch.tensor([n - next_n + j for n in lengths for j in range(next_n)], device=device)
    return plan, len(lengths) * next_n, positions


if __name__ == "__main__":
    main()
