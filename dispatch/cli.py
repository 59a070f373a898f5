"""`python -m dispatch`: explain, validate, backends, schema, bench, tune. The one place that turns the
project's errors into messages and exit codes (EXIT_CODES below)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from dispatch.errors import BackendError, DispatchError, InvalidKeyError, NoBackendError
from dispatch.key import Arch, Fp8Dtype, ForwardMode, Op
from dispatch.limits import MAX_CLI_BATCH, MAX_CLI_NEXT_N, MAX_CLI_PLAN_TOKENS, MAX_CLI_SEQ_LEN
from dispatch.version import dispatch_version

EXIT_OK, EXIT_NO_BACKEND, EXIT_INVALID, EXIT_BACKEND = 0, 1, 2, 3
EXIT_CODES = (
    (EXIT_OK, "done (explain: a backend was decided for every op asked)"),
    (EXIT_NO_BACKEND, "no backend fits the key"),
    (EXIT_INVALID, "invalid input: a bad registry, key, batch, option or plugin (the message names file, line and key)"),
    (EXIT_BACKEND, "a backend raised while running (bench); the message names backend, op, key and rule"),
)
DESCRIPTION = (
    "Declarative hardware dispatch for the DeepSeek sparse-attention indexer: which backend runs each "
    "indexer op on a machine, and why."
)
# 128 + SIGPIPE, what a shell reports for a program whose reader (`| head`) went away.
EXIT_BROKEN_PIPE = 141


class _UsageError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser, self.message = parser, message


class _Parser(argparse.ArgumentParser):
    """argparse that raises on a usage error instead of exiting, so that main answers in JSON to a
    `--json` caller here too (subcommand parsers are of this class as well)."""

    def error(self, message: str):
        raise _UsageError(self, message)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the CLI; `prog` is how usage names the program (default: the invoked script's name)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser(prog).parse_args(argv)
    except _UsageError as usage:
        usage.parser.print_usage(sys.stderr)
        print(f"{usage.parser.prog}: error: {usage.message}", file=sys.stderr)
        if "--json" in argv:
            _print_json_error("UsageError", EXIT_INVALID, usage.message)
        return EXIT_INVALID
    from dispatch.logs import show_logs

    show_logs(args.verbose)
    try:
        return args.command(args)
    except BrokenPipeError:
        # The reader closed the pipe; later writes (and the interpreter's flush at exit) would raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except NoBackendError as error:
        return _fail(args, error, EXIT_NO_BACKEND)
    except BackendError as error:
        return _fail(args, error, EXIT_BACKEND)
    except DispatchError as error:
        return _fail(args, error, EXIT_INVALID)


def _fail(args: argparse.Namespace, error: DispatchError, code: int) -> int:
    print(f"dispatch: {error}", file=sys.stderr)
    if getattr(args, "json", False):
        _print_json_error(type(error).__name__, code, str(error))
    return code


def _print_json_error(kind: str, code: int, message: str) -> None:
    print(json.dumps({"error": {"type": kind, "exit_code": code, "message": message}}, indent=2))


def _parser(prog: str | None = None) -> argparse.ArgumentParser:
    from dispatch.environment import environment_text

    codes = "exit codes:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES)
    parser = _Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=f"{environment_text()}\n\n{codes}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s (dispatch-dsa {dispatch_version()})")
    _verbosity(parser, default=0)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, help: str, function) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")
        _verbosity(sub, default=argparse.SUPPRESS)  # after the command too, without overriding one before it
        sub.set_defaults(command=function)
        return sub

    explain = command("explain", "the chosen path for a key, the rule that chose it, and every rejection", _explain)
    explain.add_argument("--op", choices=[o.value for o in Op] + ["all"], default=None,
                         help="the op to explain, or all (default: the mode's logits op: ragged_mqa_logits for "
                              "extend, paged_mqa_logits otherwise)")
    explain.add_argument("--arch", choices=[a.value for a in Arch],
                         help="explain for this arch, a what-if when it is not this machine's (default: this machine's)")
    explain.add_argument("--forward-mode", choices=[m.value for m in ForwardMode], default="decode",
                         help="the batch's forward mode (default: %(default)s)")
    explain.add_argument("--next-n", type=_next_n, default=None,
                         help=f"tokens scored per request (default: 1 for decode and extend, else 2; at most {MAX_CLI_NEXT_N})")
    explain.add_argument("--fp8-dtype", choices=[d.value for d in Fp8Dtype],
                         help="the K cache's fp8 dtype (default: the arch's platform dtype)")
    explain.add_argument("--seq-lens", type=_seq_lens, metavar="L,L,...",
                         help="explain a whole batch plan: each request's total length L, drafts included, "
                              f"each at least next-n (e.g. 130,64,7); at most {MAX_CLI_BATCH} requests of at most "
                              f"{MAX_CLI_SEQ_LEN} tokens; with --forward-mode extend, each request's new tokens")
    explain.add_argument("--prefix-lens", type=_prefix_lens, metavar="P,P,...",
                         help="with --forward-mode extend and --seq-lens: each request's keys already cached "
                              "(default: all 0)")
    explain.add_argument("--logits-budget", type=int, default=None, metavar="BYTES",
                         help="with --forward-mode extend and --seq-lens: each chunk's fp32 logits budget "
                              "(default: 512 MiB)")
    explain.add_argument("--engine", choices=["sglang"], default=None,
                         help="also say what this engine would choose by its own rules, beside dispatch's decision")
    _common(explain)

    validate = command("validate", "validate and lint a registry file", _validate)
    validate.add_argument("path", nargs="?", help="the registry file (default: DISPATCH_REGISTRY, else the packaged registry.yaml)")

    backends = command("backends", "every registered backend, its support and availability here", _backends)
    backends.add_argument("--json", action="store_true", help="print a JSON list of backends instead of text")

    command("schema", "the JSON Schema of registry.yaml, for editors", _schema)

    from dispatch.bench.command import add_arguments

    add_arguments(command("bench", "check then time every backend available here", _bench))

    from dispatch.bench.tune import add_arguments as add_tune_arguments

    add_tune_arguments(command("tune", "measure a cluster's workload here and write its measured overlay", _tune))
    return parser


def _verbosity(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=default,
                        help="show dispatch's log on stderr: -v each decision (INFO), -vv debug")


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
    # Only the upper bound here: a length below next_n is ForwardBatch's to refuse, naming the request.
    lens = [_bounded(part.strip(), "a --seq-lens length", MAX_CLI_SEQ_LEN, low=None) for part in parts]
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
    parser.add_argument("--registry", help="registry file (default: DISPATCH_REGISTRY, else the packaged registry.yaml)")
    parser.add_argument("--json", action="store_true",
                        help='print {"decisions": [...], "plan": ...} (or {"error": ...}) as JSON instead of text')


def _explain(args: argparse.Namespace) -> int:
    from dispatch.detect import detect_arch, platform_fp8_dtype
    from dispatch.explain import explain
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
    if args.op is None:
        args.op = (Op.RAGGED_MQA_LOGITS if mode is ForwardMode.EXTEND else Op.PAGED_MQA_LOGITS).value
    ops = [op for op in Op if op in ops_for(mode)] if args.op == "all" else [Op(args.op)]
    explanation = explain(dispatcher, key, ops=ops, seq_lens=args.seq_lens)
    engine = _engine_choices(args.engine, key, ops)
    if args.json:
        print(json.dumps({**explanation.as_dict(), **({"engine": [c.as_dict() for c in engine]} if engine else {})}, indent=2))
        return EXIT_OK
    if not dispatcher.check_availability:
        print(f"(this machine is {detect_arch().value}; explaining {arch.value} as a what-if)")
    print(explanation.text())
    if engine:
        from dispatch.engines.sglang.rules import choices_text

        print("\n" + choices_text(engine))
    return EXIT_OK


def _engine_choices(engine: str | None, key, ops) -> list:
    """What `engine` would run for each op by its own rules (dispatch/engines/<engine>/rules.py)."""
    if engine is None:
        return []
    from dispatch.engines.sglang.rules import sglang_choices

    return sglang_choices(key, ops)


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
    plan = build_extend_plan(dispatcher, batch, kv_fp8_dtype=key.fp8_dtype, arch=key.arch, logits_byte_budget=budget,
                             prepare=False)
    meta = plan.metadata
    if as_json:  # the shape of every --json explain: {"decisions": [...], "plan": {...}}
        described = {key: value for key, value in plan.as_dict().items() if key != "decisions"}
        described |= {"ks": meta.ks.tolist(), "ke": meta.ke.tolist()}
        decisions = [decision.as_dict() for decision in plan.decisions.values()]
        print(json.dumps({"decisions": decisions, "plan": described}, indent=2))
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
    from dispatch.registry.measured import stale_evidence, this_machine
    from dispatch.runtime import load_plugins, registry_path

    document = load_registry(registry_path(args.path))
    catalog = collect_backends(load_plugins())
    unknown = unknown_backend_names(document, catalog)
    found = sorted(
        [("dispatch", f) for f in unknown] + [("lint", f) for f in findings(document, catalog)],
        key=lambda pair: pair[1].line or 0,
    )
    # Warned, not failed (the choice still stands), and only for overlays measured on this kind of machine.
    for warning in stale_evidence(document, catalog, machine=this_machine()):
        print(f"warning: {warning}", file=sys.stderr)
    for label, finding in found:
        print(f"{label}: {finding}", file=sys.stderr)
    if found:
        return EXIT_INVALID
    tables = document.registry.ops
    rules = sum(len(t.rules) for t in tables.values())
    per_op = ", ".join(f"{op.value} {len(tables[op].rules)}" for op in Op if op in tables)
    print(
        f"ok: {document.path}: {rules} rules over {len(tables)} ops ({per_op}), "
        f"{len(document.registry.clusters)} clusters, {len(document.measured)} measured overlays "
        f"(fingerprint {document.fingerprint})"
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


def _bench(args: argparse.Namespace) -> int:
    from dispatch.bench.command import run_bench

    return run_bench(args)


def _tune(args: argparse.Namespace) -> int:
    from dispatch.bench.tune import run_tune

    return run_tune(args)
