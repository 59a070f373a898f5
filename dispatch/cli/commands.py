"""`python -m dispatch`: explain, validate, backends, gpus, schema, bench, tune. The one place that turns the
project's errors into messages and exit codes (EXIT_CODES below)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from dispatch.contract.errors import BackendError, DispatchError, InvalidKeyError, NoBackendError
from dispatch.contract.key import Arch, Fp8Dtype, ForwardMode, Op
from dispatch.contract.limits import (
    MAX_CLI_BATCH,
    MAX_CLI_NEXT_N,
    MAX_CLI_PLAN_TOKENS,
    MAX_CLI_SEQ_LEN,
    MAX_ERRORS_LISTED,
    clipped,
)
from dispatch.contract.version import dispatch_version

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
    from dispatch.cli.logs import show_logs

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
    message = _bounded_lines(str(error))
    print(f"dispatch: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        _print_json_error(type(error).__name__, code, message)
    return code


def _bounded_lines(text: str) -> str:
    """At most MAX_ERRORS_LISTED lines of at most MAX_MESSAGE_CHARS each: what the CLI prints stays bounded
    whatever an error carries (the README's promise, for every command)."""
    lines = [clipped(line) for line in text.splitlines() or [""]]
    if len(lines) > MAX_ERRORS_LISTED:
        lines = lines[:MAX_ERRORS_LISTED] + [f"... and {len(lines) - MAX_ERRORS_LISTED} more lines"]
    return "\n".join(lines)


def _print_json_error(kind: str, code: int, message: str) -> None:
    print(json.dumps({"error": {"type": kind, "exit_code": code, "message": message}}, indent=2))


def _parser(prog: str | None = None) -> argparse.ArgumentParser:
    from dispatch.cli.environment import environment_text

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
    machine = explain.add_mutually_exclusive_group()
    machine.add_argument("--gpu", metavar="NAME",
                         help="explain for the machine of this GPU, by short or marketing name (h200, \"NVIDIA H200\", "
                              "b200, mi300x; `python -m dispatch gpus` lists them): its arch, fp8 dtype and the "
                              "cluster it would match")
    machine.add_argument("--arch", type=_arch, metavar="{" + ",".join(a.value for a in Arch) + "}",
                         help="explain for this arch, a what-if when it is not this machine's (default: this machine's)")
    explain.add_argument("--forward-mode", type=_forward_mode, default=None, metavar="{" + ",".join(EXPLAINED_MODES) + "}",
                         help="the batch's forward mode (default: extend with --extend-lens, else decode; `idle`, a rank with no tokens this "
                              "step, runs no indexer op and has nothing to explain)")
    explain.add_argument("--next-n", type=_next_n, default=None,
                         help=f"tokens scored per request (default: 1 for decode and extend, else 2; at most {MAX_CLI_NEXT_N})")
    explain.add_argument("--fp8-dtype", choices=[d.value for d in Fp8Dtype],
                         help="the K cache's fp8 dtype (default: the arch's platform dtype)")
    explain.add_argument("--seq-lens", type=_seq_lens, metavar="L,L,...",
                         help="explain a paged batch's plan (decode, target_verify, draft_extend): each request's "
                              "total length L, drafts included, each at least next-n (e.g. 130,64,7); at most "
                              f"{MAX_CLI_BATCH} requests of at most {MAX_CLI_SEQ_LEN} tokens")
    explain.add_argument("--batch-size", type=_batch_size, default=None, metavar="B",
                         help="the batch's request count, which picks the cluster's measured batch-size band where "
                              "its overlay has bands (default: the count of --seq-lens or --extend-lens; without any, "
                              f"the key's own measured order, each band's choice listed); 1 to {MAX_CLI_BATCH}")
    explain.add_argument("--max-seq-len", type=_max_seq_len, default=None, metavar="L",
                         help="with --batch-size: the batch's declared bound on its longest request (a plan's "
                              "PagedBatch.max_seq_len), which picks the length sub-band inside the measured band "
                              "where it has them (default: the band's own order, each sub-band's choice listed; "
                              f"--seq-lens gives its longest); 1 to {MAX_CLI_SEQ_LEN}")
    explain.add_argument("--extend-lens", type=_extend_lens, metavar="E,E,...",
                         help="explain an extend batch's plan, --forward-mode extend implied: each "
                              "request's new tokens E, scored after its --prefix-lens cached keys (e.g. 100,3,700)")
    explain.add_argument("--prefix-lens", type=_prefix_lens, metavar="P,P,...",
                         help="with --extend-lens: each request's keys already cached "
                              "(default: all 0)")
    explain.add_argument("--logits-budget", type=int, default=None, metavar="BYTES",
                         help="with --extend-lens: each chunk's fp32 logits budget "
                              "(default: 512 MiB)")
    explain.add_argument("--engine", choices=["sglang", "vllm"], default=None,
                         help="also say what this engine would run for the key by its own rules, beside dispatch's "
                              "decision")
    _common(explain)

    validate = command("validate", "validate and lint a registry file", _validate)
    validate.add_argument("path", nargs="?", help="the registry file (default: DISPATCH_REGISTRY, else the packaged registry.yaml)")

    backends = command("backends", "every registered backend, its support and availability here", _backends)
    backends.add_argument("--json", action="store_true", help="print a JSON list of backends instead of text")
    backends.add_argument("--warm", action="store_true",
                          help="first do each backend's slow first-use work on this machine (cuda.radix's nvcc build, "
                               "cached per user; a cached failed build is tried again), reporting each on stderr; "
                               "exit 3 if one that should run here fails")

    command("schema", "the JSON Schema of registry.yaml, for editors", _schema)

    gpus = command("gpus", "each GPU known by name: its arch, the backend decided per op and mode, how each was "
                           "verified", _gpus)
    gpus.add_argument("--format", choices=["text", "markdown", "json"], default="text",
                      help="text columns, the README's markdown table, or JSON (default: %(default)s)")
    gpus.add_argument("--registry", help="registry file (default: DISPATCH_REGISTRY, else the packaged registry.yaml)")

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


def _batch_size(text: str) -> int:
    return _bounded(text, "--batch-size", MAX_CLI_BATCH)


def _max_seq_len(text: str) -> int:
    return _bounded(text, "--max-seq-len", MAX_CLI_SEQ_LEN)


def _next_n(text: str) -> int:
    return _bounded(text, "--next-n", MAX_CLI_NEXT_N, low=None)  # below 1: the key's own message


def _seq_lens(text: str, option: str = "--seq-lens") -> list[int]:
    parts = text.split(",")
    if len(parts) > MAX_CLI_BATCH:
        raise argparse.ArgumentTypeError(f"{option} lists {len(parts)} requests; at most {MAX_CLI_BATCH}")
    # Only the upper bound here: a length below next_n is PagedBatch's to refuse, naming the request.
    lens = [_bounded(part.strip(), f"a {option} length", MAX_CLI_SEQ_LEN, low=None) for part in parts]
    if len(lens) * max(lens) > MAX_CLI_PLAN_TOKENS:
        raise argparse.ArgumentTypeError(
            f"{option}: {len(lens)} requests x the longest ({max(lens)}) is past {MAX_CLI_PLAN_TOKENS} tokens, "
            "too large a block table to print"
        )
    return lens


def _extend_lens(text: str) -> list[int]:
    return _seq_lens(text, "--extend-lens")


def _arch(text: str) -> str:
    """An arch name; a GPU's name (`h200`) is refused with the arch it has."""
    if text in {a.value for a in Arch}:
        return text
    from dispatch.deciding.gpus import gpu_name_hint

    allowed = ", ".join(a.value for a in Arch)
    raise argparse.ArgumentTypeError(gpu_name_hint(text) or f"invalid choice: {text[:40]!r} (choose from {allowed})")


# The modes a batch runs the indexer in; `idle` (a data-parallel rank with no tokens) runs none of its ops.
EXPLAINED_MODES = tuple(m.value for m in ForwardMode if m is not ForwardMode.IDLE)


def _forward_mode(text: str) -> str:
    if text in EXPLAINED_MODES:
        return text
    if text == ForwardMode.IDLE.value:
        raise argparse.ArgumentTypeError(
            "forward mode idle is a rank with no tokens this step: it runs no indexer op, so nothing is decided"
        )
    raise argparse.ArgumentTypeError(f"invalid choice: {text[:40]!r} (choose from {', '.join(EXPLAINED_MODES)})")


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
    from dispatch.contract.detect import detect_arch, platform_fp8_dtype
    from dispatch.cli.explain import explain
    from dispatch.deciding.gpus import find_gpu
    from dispatch.contract.key import DispatchKey
    from dispatch.step.paged_plan import ops_for
    from dispatch.deciding.runtime import load_dispatcher

    gpu = find_gpu(args.gpu) if args.gpu else None
    arch = gpu.arch if gpu else Arch(args.arch) if args.arch else detect_arch()
    mode = _explained_mode(args)
    batch_size = _explained_batch_size(args)
    single = mode in (ForwardMode.DECODE, ForwardMode.EXTEND)
    next_n = args.next_n if args.next_n is not None else (1 if single else 2)
    fp8 = Fp8Dtype(args.fp8_dtype) if args.fp8_dtype else gpu.fp8_dtype if gpu else platform_fp8_dtype(arch)
    key = DispatchKey(arch=arch, forward_mode=mode, next_n=next_n, fp8_dtype=fp8)
    dispatcher = load_dispatcher(args.registry, cluster=args.cluster, arch=arch,
                                 device_name=gpu.device_name if gpu else None)
    if args.extend_lens:
        return _explain_extend_plan(dispatcher, key, args.extend_lens, args.prefix_lens, args.logits_budget, args.json)
    if args.op is None:
        args.op = (Op.RAGGED_MQA_LOGITS if mode is ForwardMode.EXTEND else Op.PAGED_MQA_LOGITS).value
    ops = [op for op in Op if op in ops_for(mode)] if args.op == "all" else [Op(args.op)]
    explanation = explain(dispatcher, key, ops=ops, seq_lens=args.seq_lens, batch_size=batch_size,
                          max_seq_len=_explained_max_seq_len(args, batch_size))
    engine = _engine_report(args.engine, key, ops) if args.engine else None
    if args.json:
        print(json.dumps({**explanation.as_dict(), **({"engine": engine[0]} if engine else {})}, indent=2))
        return EXIT_OK
    if not dispatcher.check_availability:
        from dispatch.cli.gpu_table import what_if_note

        print(what_if_note(dispatcher, detect_arch(), gpu, cluster_named=bool(args.cluster)))
    print(explanation.text())
    if engine:
        print("\n" + engine[1])
        for decision in explanation.decisions:
            if decision.op in (Op.PAGED_MQA_LOGITS, Op.RAGGED_MQA_LOGITS):
                print(f"dispatch runs: {decision.backend} ({decision.layout.value}, rule {decision.rule})")
    return EXIT_OK


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _explained_mode(args: argparse.Namespace) -> ForwardMode:
    """The forward mode, from --forward-mode or implied by --extend-lens; lengths of the other kind of
    batch are refused, saying which option that batch takes."""
    if args.extend_lens:
        if args.forward_mode not in (None, ForwardMode.EXTEND.value):
            raise InvalidKeyError(f"--extend-lens is an extend batch's; --forward-mode {args.forward_mode} takes "
                                  "--seq-lens (each request's total length)")
        return ForwardMode.EXTEND
    mode = ForwardMode(args.forward_mode or ForwardMode.DECODE.value)
    if args.seq_lens and mode is ForwardMode.EXTEND:
        raise InvalidKeyError("--seq-lens is a paged batch's total lengths; an extend batch takes --extend-lens "
                              "(each request's new tokens) and --prefix-lens (its cached keys)")
    if (args.prefix_lens is not None or args.logits_budget is not None) and not args.extend_lens:
        raise InvalidKeyError("--prefix-lens and --logits-budget go with --extend-lens (an extend batch)")
    return mode


def _explained_batch_size(args: argparse.Namespace) -> int | None:
    """--batch-size, or the count of the lengths given; both must then say the same."""
    lengths, option = (args.seq_lens, "--seq-lens") if args.seq_lens else (args.extend_lens, "--extend-lens")
    if not lengths:
        return args.batch_size
    if args.batch_size is not None and args.batch_size != len(lengths):
        raise InvalidKeyError(f"--batch-size {args.batch_size} but {option} lists {len(lengths)} requests; "
                              f"{option} gives the batch's size (leave --batch-size out)")
    return len(lengths)


def _explained_max_seq_len(args: argparse.Namespace, batch_size: int | None) -> int | None:
    """--max-seq-len, which a band's length sub-band is picked by: only beside a batch size (a plan
    declares both), and not with --seq-lens, whose longest is the batch's bound."""
    if args.max_seq_len is None:
        return None
    if args.seq_lens or args.extend_lens:
        raise InvalidKeyError("--max-seq-len with --seq-lens or --extend-lens: the lengths give the batch's "
                              "longest request (leave --max-seq-len out)")
    if batch_size is None:
        raise InvalidKeyError("--max-seq-len picks a length sub-band inside a batch-size band: give --batch-size too")
    return args.max_seq_len


def _engine_report(engine: str, key, ops) -> tuple[list[dict], str]:
    """What `engine` would run for `key` by its own rules (dispatch/engines/<engine>/rules.py), as JSON
    rows and as text."""
    if engine == "sglang":
        from dispatch.engines.sglang.rules import choices_text, sglang_choices

        choices = sglang_choices(key, ops)
        return [c.as_dict() for c in choices], choices_text(choices)
    from dispatch.engines.vllm.rules import vllm_choice

    choice = vllm_choice(key)
    return [choice.as_dict()], choice.text()


def _explain_extend_plan(dispatcher, key, extend_lens: list[int], prefix_lens: list[int] | None,
                         budget: int | None, as_json: bool) -> int:
    """Build the extend plan an engine would build for this batch (on the CPU) and show its decisions,
    ragged metadata shapes and chunks."""
    from dispatch.contract.paged_cache import page_table_for
    from dispatch.cli.explain import decision_text
    from dispatch.step.extend_plan import build_extend_plan
    from dispatch.step.extend_batch import DEFAULT_LOGITS_BYTES, ExtendBatch

    prefix = prefix_lens or [0] * len(extend_lens)
    if len(prefix) != len(extend_lens):
        raise InvalidKeyError(f"--prefix-lens has {len(prefix)} requests, --extend-lens {len(extend_lens)}")
    if sum(prefix) + sum(extend_lens) > MAX_CLI_PLAN_TOKENS:
        raise InvalidKeyError(f"--prefix-lens and --extend-lens add up to more than {MAX_CLI_PLAN_TOKENS} keys, "
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
    checked), else overlays that cannot be attached, unknown backend names, lint, coverage and keys a
    cluster leaves without a backend together. Imports no torch, so it checks what an engine's
    assembly (load_dispatcher) checks except this machine's cluster match."""
    from dispatch.contract.host import collect_backends
    from dispatch.registry.checks import findings, unknown_backend_names
    from dispatch.deciding.cluster_coverage import cluster_coverage
    from dispatch.registry.document import load_registry
    from dispatch.registry.measured import stale_evidence, this_machine
    from dispatch.deciding.runtime import load_plugins, registry_path

    overlay_problems: list[str] = []
    document = load_registry(registry_path(args.path), overlay_problems)
    catalog = collect_backends(load_plugins())
    unknown = unknown_backend_names(document, catalog)
    # A cluster's coverage is asked of the dispatcher, which needs every name it is given to be known.
    clusters = [] if unknown else cluster_coverage(document, catalog)
    found = [("dispatch", problem) for problem in overlay_problems] + sorted(
        [("dispatch", f) for f in unknown] + [("lint", f) for f in findings(document, catalog) + clusters],
        key=lambda pair: pair[1].line or 0,
    )
    # Warned, not failed (the choice still stands), and only for overlays measured on this kind of machine.
    warnings = [f"warning: {w}" for w in stale_evidence(document, catalog, machine=this_machine())]
    problems = [f"{label}: {finding}" for label, finding in found]
    for line in _listed_at_most(warnings) + _listed_at_most(problems):
        print(clipped(line), file=sys.stderr)
    if found:
        return EXIT_INVALID
    tables = document.registry.ops
    rules = sum(len(t.rules) for t in tables.values())
    per_op = ", ".join(f"{op.value} {len(tables[op].rules)}" for op in Op if op in tables)
    print(
        f"ok: {document.path}: {rules} rules over {len(tables)} ops ({per_op}), "
        f"{_count(len(document.registry.clusters), 'cluster')}, {_count(len(document.measured), 'measured overlay')} "
        f"(fingerprint {document.fingerprint})"
    )
    return EXIT_OK


def _listed_at_most(lines: list[str]) -> list[str]:
    """The first MAX_ERRORS_LISTED lines and a count of the rest, as a registry's own errors are listed."""
    if len(lines) <= MAX_ERRORS_LISTED:
        return lines
    return lines[:MAX_ERRORS_LISTED] + [f"... and {len(lines) - MAX_ERRORS_LISTED} more"]


def _backends(args: argparse.Namespace) -> int:
    from dispatch.cli.explain import backend_row, backends_text
    from dispatch.contract.host import collect_backends
    from dispatch.deciding.runtime import load_plugins

    catalog = collect_backends(load_plugins())
    failures = _warm_backends(catalog) if args.warm else []
    rows = [backend_row(b) for b in catalog.backends]  # probed after the warm-up: they see its builds
    print(json.dumps(rows, indent=2) if args.json else backends_text(rows))
    if failures:
        raise BackendError("\n".join(failures))
    return EXIT_OK


def _warm_backends(catalog) -> list[str]:
    """Warm every backend with a warm-up that could serve this machine's arch; the failures' messages."""
    from dispatch.contract import detect_arch
    from dispatch.deciding.warming import warm_backend, warmable

    failures = []
    for backend in warmable(catalog, detect_arch(), available_only=False):
        print(f"warm: {backend.name}: ...", file=sys.stderr, flush=True)
        try:
            warmed = warm_backend(backend)
        except BackendError as error:
            print(f"warm: {backend.name}: FAILED", file=sys.stderr)
            failures.append(str(error))
            continue
        ready = f"ready ({warmed.seconds:.1f} s)" + (f"; {warmed.availability.reason}" if warmed.availability.reason else "")
        state = ready if warmed.availability.ok else f"nothing to build here: {warmed.availability.reason}"
        print(f"warm: {backend.name}: {state}", file=sys.stderr)
    return failures


def _gpus(args: argparse.Namespace) -> int:
    from dispatch.cli import gpu_table
    from dispatch.contract.host import collect_backends
    from dispatch.registry.document import load_registry
    from dispatch.deciding.runtime import load_plugins, registry_path

    rows = gpu_table.gpu_rows(load_registry(registry_path(args.registry)), collect_backends(load_plugins()))
    if args.format == "json":
        print(json.dumps([row.as_dict() for row in rows], indent=2))
    else:
        print(gpu_table.markdown(rows) if args.format == "markdown" else gpu_table.text(rows))
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
