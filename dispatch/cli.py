"""`python -m dispatch`: explain, validate, backends, schema, bench. The one place that turns the
project's errors into messages and exit codes: 0 success, 1 no backend fits, 2 invalid input."""

from __future__ import annotations

import argparse
import json
import sys

from dispatch.errors import DispatchError, InvalidKeyError, NoBackendError
from dispatch.key import Arch, Fp8Dtype, ForwardMode, Op
from dispatch.limits import MAX_CLI_BATCH, MAX_CLI_NEXT_N, MAX_CLI_PLAN_TOKENS, MAX_CLI_SEQ_LEN

EXIT_OK, EXIT_NO_BACKEND, EXIT_INVALID = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.command(args)
    except NoBackendError as error:
        print(f"dispatch: {error}", file=sys.stderr)
        return EXIT_NO_BACKEND
    except DispatchError as error:
        print(f"dispatch: {error}", file=sys.stderr)
        return EXIT_INVALID


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dispatch", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    explain = commands.add_parser("explain", help="the chosen path for a key, the rule that chose it, and every rejection")
    explain.add_argument(
        "--op",
        choices=[o.value for o in Op] + ["all"],
        default=None,
        help="default: the mode's logits op (ragged_mqa_logits for extend, paged_mqa_logits otherwise)",
    )
    explain.add_argument("--arch", choices=[a.value for a in Arch], help="default: this machine's")
    explain.add_argument("--forward-mode", choices=[m.value for m in ForwardMode], default="decode")
    explain.add_argument(
        "--next-n", type=_next_n, default=None,
        help=f"default: 1 (decode, extend), else 2; at most {MAX_CLI_NEXT_N}",
    )
    explain.add_argument("--fp8-dtype", choices=[d.value for d in Fp8Dtype], help="default: the arch's platform dtype")
    explain.add_argument(
        "--seq-lens",
        type=_seq_lens,
        help="explain a whole batch plan: each request's total length L, drafts included (e.g. 130,64,7); "
        f"with --forward-mode extend, each request's new tokens; at most {MAX_CLI_BATCH} requests of at most "
        f"{MAX_CLI_SEQ_LEN} tokens",
    )
    explain.add_argument(
        "--prefix-lens",
        type=_prefix_lens,
        help="with --forward-mode extend and --seq-lens: each request's keys already cached (default: all 0)",
    )
    explain.add_argument(
        "--logits-budget",
        type=int,
        default=None,
        help="with --forward-mode extend and --seq-lens: each chunk's fp32 logits budget in bytes (default: 512 MiB)",
    )
    _common(explain)
    explain.set_defaults(command=_explain)

    validate = commands.add_parser("validate", help="validate and lint a registry file")
    validate.add_argument("path", nargs="?", help="default: the project's registry.yaml")
    validate.set_defaults(command=_validate)

    backends = commands.add_parser("backends", help="every registered backend, its support and availability here")
    backends.add_argument("--json", action="store_true")
    backends.set_defaults(command=_backends)

    schema = commands.add_parser("schema", help="the JSON Schema of registry.yaml, for editors")
    schema.set_defaults(command=_schema)

    bench = commands.add_parser("bench", help="check then time every backend available here")
    _bench_arguments(bench)
    return parser


def _bounded(text: str, what: str, high: int, low: int | None = 1) -> int:
    """An int in low..high, refused (argparse: exit 2) before anything is built from it: a huge next_n
    or length would otherwise build a plan for minutes or overflow a tensor."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} {text[:40]!r} is not an integer") from None
    if value > high or (low is not None and value < low):
        shown = text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"
        raise argparse.ArgumentTypeError(f"{what} is {shown}; it must be from 1 to {high}")
    return value


def _next_n(text: str) -> int:
    return _bounded(text, "--next-n", MAX_CLI_NEXT_N, low=None)  # below 1: the key's own message


def _seq_lens(text: str) -> list[int]:
    parts = text.split(",")
    if len(parts) > MAX_CLI_BATCH:
        raise argparse.ArgumentTypeError(f"--seq-lens lists {len(parts)} requests; at most {MAX_CLI_BATCH}")
    lens = [_bounded(part.strip(), "a --seq-lens length", MAX_CLI_SEQ_LEN) for part in parts]
    if len(lens) * max(lens) > MAX_CLI_PLAN_TOKENS:
        raise argparse.ArgumentTypeError(
            f"--seq-lens: {len(lens)} requests x the longest ({max(lens)}) is past {MAX_CLI_PLAN_TOKENS} tokens, "
            "too large a block table to print"
        )
    return lens


def _prefix_lens(text: str) -> list[int]:
    parts = text.split(",")
    if len(parts) > MAX_CLI_BATCH:
        raise argparse.ArgumentTypeError(f"--prefix-lens lists {len(parts)} requests; at most {MAX_CLI_BATCH}")
    lens = [_bounded(part.strip(), "a --prefix-lens length", MAX_CLI_SEQ_LEN, low=None) for part in parts]
    if min(lens) < 0:
        raise argparse.ArgumentTypeError(f"a --prefix-lens length is {min(lens)}; lengths must be >= 0")
    return lens


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", help="cluster overlay (default: DISPATCH_CLUSTER, else a declared match)")
    parser.add_argument("--registry", help="registry file (default: DISPATCH_REGISTRY, else registry.yaml)")
    parser.add_argument("--json", action="store_true")


def _explain(args: argparse.Namespace) -> int:
    from dispatch.detect import detect_arch, platform_fp8_dtype
    from dispatch.explain import decision_text
    from dispatch.key import DispatchKey
    from dispatch.plan import ops_for
    from dispatch.runtime import load_dispatcher

    arch = Arch(args.arch) if args.arch else detect_arch()
    mode = ForwardMode(args.forward_mode)
    single = mode in (ForwardMode.DECODE, ForwardMode.EXTEND)
    next_n = args.next_n if args.next_n is not None else (1 if single else 2)
    fp8 = Fp8Dtype(args.fp8_dtype) if args.fp8_dtype else platform_fp8_dtype(arch)
    key = DispatchKey(arch=arch, forward_mode=mode, next_n=next_n, fp8_dtype=fp8)
    dispatcher = load_dispatcher(args.registry, cluster=args.cluster, arch=arch)
    if args.prefix_lens is not None and (mode is not ForwardMode.EXTEND or not args.seq_lens):
        raise InvalidKeyError("--prefix-lens goes with --forward-mode extend and --seq-lens")
    if args.seq_lens and mode is ForwardMode.EXTEND:
        return _explain_extend_plan(dispatcher, key, args.seq_lens, args.prefix_lens, args.logits_budget, args.json)
    if args.seq_lens:
        return _explain_plan(dispatcher, key, args.seq_lens, args.json)
    if args.op is None:
        args.op = (Op.RAGGED_MQA_LOGITS if mode is ForwardMode.EXTEND else Op.PAGED_MQA_LOGITS).value
    ops = [op for op in Op if op in ops_for(mode)] if args.op == "all" else [Op(args.op)]
    decisions = [dispatcher.decide(op, key) for op in ops]
    if args.json:
        payload = [d.as_dict() for d in decisions]
        print(json.dumps(payload if args.op == "all" else payload[0], indent=2))
    else:
        if not decisions[0].availability_checked:
            print(f"(this machine is {detect_arch().value}; explaining {arch.value} as a what-if)")
        print("\n\n".join(decision_text(d, dispatcher) for d in decisions))
    return EXIT_OK


def _explain_plan(dispatcher, key, seq_lens: list[int], as_json: bool) -> int:
    """Build the plan an engine would build for this batch (on the CPU) and show it whole."""
    import torch

    from dispatch.bench.paged_cache import page_table_for
    from dispatch.explain import decision_text
    from dispatch.plan import ForwardBatch, build_plan

    table = page_table_for(seq_lens)
    batch = ForwardBatch(torch.tensor(seq_lens, dtype=torch.int32), table, max(seq_lens), key.forward_mode, key.next_n)
    plan = build_plan(dispatcher, batch, kv_fp8_dtype=key.fp8_dtype, arch=key.arch)
    payload = {**plan.as_dict(), "context_lens": plan.context_lens.tolist(), "block_table": plan.block_table.tolist()}
    if as_json:
        print(json.dumps(payload, indent=2))
        return EXIT_OK
    print(f"plan for B={plan.batch_size}, next_n={plan.next_n}, max_context_len={plan.max_context_len}")
    print(f"  context_lens {list(plan.context_lens.shape)} ({plan.layout.value}): {payload['context_lens']}")
    print(f"  block_table {list(plan.block_table.shape)}: {payload['block_table']}")
    print()
    print("\n\n".join(decision_text(d, dispatcher) for d in plan.decisions.values()))
    return EXIT_OK


def _explain_extend_plan(dispatcher, key, extend_lens: list[int], prefix_lens: list[int] | None,
                         budget: int | None, as_json: bool) -> int:
    """Build the extend plan an engine would build for this batch (on the CPU) and show its decisions,
    ragged metadata shapes and chunks."""
    from dispatch.bench.paged_cache import page_table_for
    from dispatch.explain import decision_text
    from dispatch.extend import build_extend_plan
    from dispatch.prefill import DEFAULT_LOGITS_BYTES, ExtendBatch

    prefix = prefix_lens or [0] * len(extend_lens)
    if len(prefix) != len(extend_lens):
        raise InvalidKeyError(f"--prefix-lens has {len(prefix)} requests, --seq-lens {len(extend_lens)}")
    if sum(prefix) + sum(extend_lens) > MAX_CLI_PLAN_TOKENS:
        raise InvalidKeyError(f"--prefix-lens and --seq-lens add up to more than {MAX_CLI_PLAN_TOKENS} keys, "
                              "too large a plan to print")
    table = page_table_for([p + e for p, e in zip(prefix, extend_lens)])
    budget = DEFAULT_LOGITS_BYTES if budget is None else budget
    batch = ExtendBatch.from_lengths(prefix, extend_lens, table)
    plan = build_extend_plan(dispatcher, batch, kv_fp8_dtype=key.fp8_dtype, arch=key.arch, logits_byte_budget=budget)
    meta = plan.metadata
    payload = {**plan.as_dict(), "ks": meta.ks.tolist(), "ke": meta.ke.tolist()}
    if as_json:
        print(json.dumps(payload, indent=2))
        return EXIT_OK
    print(f"extend plan for B={len(extend_lens)}: M={meta.total_tokens} query rows, S={meta.total_keys} gathered keys")
    print(f"  ks, ke [{meta.total_tokens}] int32; gather_slots [{meta.total_keys}]; row_request [{meta.total_tokens}]; "
          f"key_offsets {meta.key_offsets.tolist()}")
    print(f"  chunks under {plan.logits_byte_budget} bytes of fp32 logits (largest {plan.peak_logits_bytes}):")
    for c in plan.chunks:
        chunk = c.chunk
        print(f"    rows [{chunk.row_begin}, {chunk.row_end}) x keys [{chunk.key_begin}, {chunk.key_end}): "
              f"logits [{chunk.row_end - chunk.row_begin}, {chunk.key_end - chunk.key_begin}], {chunk.logits_bytes} bytes")
    print()
    print("\n\n".join(decision_text(d, dispatcher) for d in plan.decisions.values()))
    return EXIT_OK


def _validate(args: argparse.Namespace) -> int:
    """Every problem of the file in one run, in file order: schema errors (all, or nothing else can be
    checked), else unknown backend names, lint and coverage together. Imports no torch, so it checks
    what an engine's assembly (load_dispatcher) checks except this machine's cluster match."""
    from dispatch.plugins import collect_backends
    from dispatch.registry.checks import findings, unknown_backend_names
    from dispatch.registry.document import load_registry
    from dispatch.runtime import load_plugins, registry_path

    document = load_registry(registry_path(args.path))
    catalog = collect_backends(load_plugins())
    unknown = unknown_backend_names(document, catalog)
    found = sorted(
        [("dispatch", f) for f in unknown] + [("lint", f) for f in findings(document, catalog)],
        key=lambda pair: pair[1].line or 0,
    )
    for label, finding in found:
        print(f"{label}: {finding}", file=sys.stderr)
    if found:
        return EXIT_INVALID
    tables = document.registry.ops
    rules = sum(len(t.rules) for t in tables.values())
    per_op = ", ".join(f"{op.value} {len(tables[op].rules)}" for op in Op if op in tables)
    print(
        f"ok: {document.path}: {rules} rules over {len(tables)} ops ({per_op}), "
        f"{len(document.registry.clusters)} clusters (fingerprint {document.fingerprint})"
    )
    return EXIT_OK


def _backends(args: argparse.Namespace) -> int:
    from dispatch.explain import backend_row, backends_text
    from dispatch.plugins import collect_backends
    from dispatch.runtime import load_plugins

    rows = [backend_row(b) for b in collect_backends(load_plugins()).backends]
    print(json.dumps(rows, indent=2) if args.json else backends_text(rows))
    return EXIT_OK


def _schema(args: argparse.Namespace) -> int:
    from dispatch.registry.models import Registry

    print(json.dumps(Registry.model_json_schema(), indent=2))
    return EXIT_OK


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from dispatch.bench.command import add_arguments

    add_arguments(parser)
    parser.set_defaults(command=_bench)


def _bench(args: argparse.Namespace) -> int:
    from dispatch.bench.command import run_bench

    return run_bench(args)
