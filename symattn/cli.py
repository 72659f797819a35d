"""The ``symattn`` command line: list, derive, generate, check, graph.

Bad input — an unknown spec, target, format or option — exits 2 with one line on
stderr and no traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import shlex
import sys
from collections.abc import Sequence

from symattn.errors import SymattnError


class UsageError(SymattnError):
    """A command-line argument argparse refused."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (see main)
        raise UsageError(f"{self.prog}: {message}")


def cmd_list(args: argparse.Namespace) -> int:
    """One line per built-in spec: name and forward expression."""
    from symattn.specs import spec, specs

    width = max(len(name) for name in specs())
    for name in specs():
        print(f"{name:{width}s}  {spec(name).summary}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Write the generated modules, or with --check report the stale ones (exit 1) and write nothing."""
    from symattn.codegen.generate import default_out_dir, generate

    out = args.out if args.out is not None else default_out_dir()
    if args.size and args.spec_file is None:
        raise UsageError(
            "symattn generate: error: --size applies to --spec-file only; the built-in modules choose their "
            "schedule from the arrays' shapes when called"
        )
    if args.option and args.spec_file is None:
        raise UsageError(
            "symattn generate: error: --option applies to --spec-file only; the built-in modules take "
            "their options at run time (e.g. forward(..., num_heads=3))"
        )
    try:
        if args.spec_file is not None:
            stale = _generate_spec_file(args)
        else:
            stale = generate(args.spec, args.backend, args.variant, out, check=args.check, order=args.order)
    except OSError as err:  # an unwritable --out: one line, exit 2, every file left as it was
        raise SymattnError(f"cannot write the generated modules to {out}: {err.strerror or err}") from None
    if args.check:
        for path in stale:
            print(f"stale: {path} (differs from what `symattn generate` renders; regenerate, do not edit)")
        if not stale:
            print(f"up to date: every generated module in {out}")
        return 1 if stale else 0
    for path in stale:
        print(f"wrote {path}")
    if not stale:
        print(f"up to date: nothing to write in {out}")
    return 0


def _generate_spec_file(args: argparse.Namespace) -> list:
    """generate --spec-file FILE --out DIR: the user's spec's modules (standard variant unless asked)."""
    from symattn.codegen.generate import generate
    from symattn.specs.files import load_spec_file

    if args.spec:
        raise UsageError("symattn generate: error: give either --spec or --spec-file, not both")
    if args.out is None:
        raise UsageError("symattn generate: error: --spec-file needs --out DIR")
    s = load_spec_file(args.spec_file, **_spec_options(args.option))
    command = ["symattn", "generate", "--spec-file", args.spec_file, "--out", args.out]
    command += [f"--option={pair}" for pair in args.option or []]
    command += [f"--backend={b}" for b in args.backend or []] + [f"--variant={v}" for v in args.variant or []]
    command += ["--order=1"] if args.order == 1 else []
    sizes = _sizes(s, args.size)
    command += [f"--size={name}={size}" for name, size in sizes.items()]
    return generate(
        [s],
        args.backend,
        args.variant,
        args.out,
        check=args.check,
        regenerate=shlex.join(command),
        order=args.order,
        sizes=sizes,
    )


def _sizes(s, pairs: Sequence[str] | None) -> dict[str, int]:
    """DIM=SIZE pairs: each a dimension of the spec's inputs and a positive integer (else one line, exit 2)."""
    import sympy as sp

    dims = sorted({str(d) for x in s.matrix_inputs for size in x.shape for d in sp.sympify(size).free_symbols})
    sizes: dict[str, int] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not value.strip().isdigit() or int(value) < 1:
            raise UsageError(f"symattn: error: --size takes DIM=SIZE with a positive integer SIZE, got {pair!r}")
        if name not in dims:
            known = ", ".join(dims)
            raise UsageError(f"symattn: error: --size {name}: spec {s.name!r} has no dimension {name!r} ({known})")
        sizes[name] = int(value)
    return sizes


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from symattn.codegen.generate import BACKENDS, VARIANTS
    from symattn.specs import specs

    gen = sub.add_parser("generate", help="write the generated NumPy, PyTorch and JAX modules")
    gen.add_argument("--spec", action="append", choices=specs(), help="a spec to generate (repeatable; default all)")
    from symattn.codegen.backends import OPTIONAL_BACKENDS

    gen.add_argument(
        "--backend",
        action="append",
        choices=[*BACKENDS, *OPTIONAL_BACKENDS],
        help=f"one backend (repeatable; default all, {', '.join(OPTIONAL_BACKENDS)} for the built-ins only)",
    )
    gen.add_argument(
        "--variant",
        action="append",
        choices=VARIANTS,
        help="standard (<spec>_<backend>) or memeff (<spec>_<backend>_memeff: P recomputed from the row "
        "log-sum-exp, query blocks, O(n·d) extra memory); repeatable, default both",
    )
    gen.add_argument("--out", help="output folder (default: the symattn.generated package folder)")
    gen.add_argument(
        "--spec-file", metavar="FILE", help="a Python file defining `spec` (a user's own spec; needs --out)"
    )
    gen.add_argument("--option", action="append", metavar="KEY=VALUE", help="an option of the --spec-file spec")
    gen.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale file")
    gen.add_argument(
        "--order",
        type=int,
        choices=(1, 2),
        default=2,
        help="2 (default): also the second closed form (double backward, hvp); 1: the first only, rendered in a "
        "fraction of the time (the torch module raises on double backward)",
    )
    gen.add_argument(
        "--size",
        action="append",
        metavar="DIM=SIZE",
        help="the size a dimension of the --spec-file spec runs at (repeatable): product orders and the other "
        "decisions of the schedule are priced there (a model width g: --size g=256); without it, a module whose "
        "best schedule depends on the sizes holds one per size regime and picks one from the arrays' shapes",
    )
    gen.set_defaults(handler=cmd_generate)


def _spec_options(pairs: Sequence[str] | None) -> dict[str, object]:
    """KEY=VALUE pairs as spec options: integers, numbers or None where they parse so, else text."""
    options: dict[str, object] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"symattn: error: --option takes KEY=VALUE, got {pair!r}")
        for convert in (int, float):
            try:
                options[key] = convert(value)
                break
            except ValueError:
                continue
        else:
            options[key] = None if value == "None" else value
    return options


def cmd_derive(args: argparse.Namespace) -> int:
    """Print the derivation of a spec's gradients; with --verify, check every equality instead (exit 1 on a failure)."""
    from symattn.derive.derivation import derive

    fmt = args.format or ("latex" if args.standalone else "text")
    if args.standalone and fmt != "latex":
        raise UsageError(f"symattn derive: error: --standalone needs --format latex, not {fmt}")
    if (args.spec is None) == (args.spec_file is None):
        raise UsageError("symattn derive: error: give either SPEC or --spec-file FILE")
    if args.spec_file is not None:
        from symattn.specs.files import load_spec_file

        derivation = derive(load_spec_file(args.spec_file, **_spec_options(args.option)))
    else:
        derivation = derive(args.spec, **_spec_options(args.option))
    if args.mode == "forward":
        return _derive_forward(derivation.spec, args, fmt)
    wrt = args.wrt
    if wrt is not None:
        derivation.spec.input(wrt)  # an unknown target is bad input (exit 2), before any work
    if args.order == 2:  # the Hessian-vector product: the derivation of f₂ = tr(V_wᵀ ∂f/∂w)
        from symattn.derive.second_order import derive_second_order

        derivation = derive_second_order(derivation.spec, wrt)
    derivation.sweep = args.sweep
    if args.verify:  # the derivation with a mark per line (✓ or the discrepancy), then the report
        report = derivation.verify(wrt)
        sys.stdout.write(derivation.text(wrt, verification=report) + "\n" + report.text())
        return 0 if report.ok else 1
    if args.cost:
        from symattn.codegen.report.cost_report import cost_report

        sys.stdout.write(cost_report(derivation).text() + "\n")
        return 0
    if fmt == "html":  # the page embeds the dataflow picture where Graphviz is installed
        sys.stdout.write(derivation.html(wrt, figure=_figure(derivation.spec)))
        return 0
    sys.stdout.write(derivation.render(fmt, wrt, standalone=args.standalone))
    return 0


def _derive_forward(spec, args: argparse.Namespace, fmt: str) -> int:
    """symattn derive --mode forward: the forward-mode derivation, or with --verify each step checked."""
    from symattn.derive.forward_mode import ForwardDerivation

    unused = [
        flag for flag, given in (("--wrt", args.wrt), ("--order 2", args.order == 2), ("--cost", args.cost)) if given
    ]
    if unused or fmt == "html" or args.sweep != "auto":
        what = unused[0] if unused else "--format html" if fmt == "html" else "--sweep"
        raise UsageError(f"symattn derive: error: --mode forward takes no {what} (every input moves at once)")
    derivation = ForwardDerivation(spec)
    if args.verify:
        checks = derivation.verify()
        sys.stdout.write(derivation.text(checks) + "\n" + derivation.report(checks))
        return 0 if all(c.ok for c in checks) else 1
    sys.stdout.write(derivation.render(fmt, standalone=args.standalone))
    return 0


def _figure(s) -> str | None:
    """The spec's forward and backward dataflow as inline SVG, or None without Graphviz's dot."""
    import shutil

    from symattn.codegen.report.picture import picture
    from symattn.derive.formats.html import inline_svg

    if not shutil.which("dot"):
        print(
            "symattn: Graphviz's dot is not installed: the page has no dataflow picture (Debian: graphviz)",
            file=sys.stderr,
        )
        return None
    return inline_svg(picture(s, backward=True, fmt="svg").decode())


def _add_derive(sub: argparse._SubParsersAction) -> None:
    from symattn.derive.derivation import FORMATS, SWEEPS
    from symattn.specs import specs

    der = sub.add_parser("derive", help="print a spec's derivation step by step (trace differentials)")
    der.add_argument("spec", nargs="?", choices=specs(), help="a built-in spec (or give --spec-file)")
    der.add_argument("--spec-file", metavar="FILE", help="a Python file defining `spec` (a user's own spec)")
    der.add_argument("--wrt", metavar="NAME", help="one input or weight (default: every one)")
    der.add_argument("--format", choices=FORMATS, help="output format (default: text, or latex with --standalone)")
    der.add_argument("--standalone", action="store_true", help="a complete LaTeX document (amsmath) for pdflatex")
    der.add_argument("--verify", action="store_true", help="check every printed equality; exit 1 if one fails")
    der.add_argument("--cost", action="store_true", help="forward and backward FLOPs and peak temporaries")
    der.add_argument(
        "--sweep",
        choices=SWEEPS,
        default="auto",
        help="shared: one backward sweep, each step printed once; per-input: a chain per input; "
        "auto (default): per-input for a small spec",
    )
    der.add_argument("--option", action="append", metavar="KEY=VALUE", help="a spec option, e.g. num_heads=2, scale=1")
    der.add_argument(
        "--order", type=int, choices=(1, 2), default=1, help="2: the Hessian-vector product H V along --wrt's V"
    )
    der.add_argument(
        "--mode",
        choices=("reverse", "forward"),
        default="reverse",
        help="reverse (default): the gradients; forward: each value's differential along the inputs' tangents "
        "(the Jacobian-vector product the generated jvp computes)",
    )
    der.set_defaults(handler=cmd_derive)


def cmd_graph(args: argparse.Namespace) -> int:
    """Draw the spec's dataflow (forward, or with --backward both passes) as SVG, PNG or DOT, to stdout or --out."""
    from symattn.codegen.report.picture import picture
    from symattn.specs import spec
    from symattn.specs.files import load_spec_file

    if (args.spec is None) == (args.spec_file is None):
        raise UsageError("symattn graph: error: give either SPEC or --spec-file FILE")
    options = _spec_options(args.option)
    s = load_spec_file(args.spec_file, **options) if args.spec_file is not None else spec(args.spec, **options)
    image = picture(s, backward=args.backward, fmt=args.format)
    if args.out is None:
        sys.stdout.flush()
        sys.stdout.buffer.write(image)
        return 0
    try:
        with open(args.out, "wb") as f:
            f.write(image)
    except OSError as err:
        raise SymattnError(f"cannot write {args.out}: {err.strerror or err}") from None
    print(f"wrote {args.out}")
    return 0


def _add_graph(sub: argparse._SubParsersAction) -> None:
    from symattn.codegen.report.picture import FORMATS
    from symattn.specs import specs

    gra = sub.add_parser("graph", help="draw the forward (and backward) dataflow with Graphviz")
    gra.add_argument("spec", nargs="?", choices=specs(), help="a built-in spec (or give --spec-file)")
    gra.add_argument("--spec-file", metavar="FILE", help="a Python file defining `spec` (a user's own spec)")
    gra.add_argument("--backward", action="store_true", help="draw the backward pass too")
    gra.add_argument("--format", choices=FORMATS, default="svg", help="svg (default), png or dot (the DOT text)")
    gra.add_argument("--out", metavar="FILE", help="write to FILE (default: stdout)")
    gra.add_argument("--option", action="append", metavar="KEY=VALUE", help="a spec option, e.g. num_heads=2")
    gra.set_defaults(handler=cmd_graph)


def cmd_check(args: argparse.Namespace) -> int:
    """Say whether a claimed gradient is right (exit 0), wrong (exit 1, a counterexample) or cannot be checked (3)."""
    from symattn.derive.check import check
    from symattn.specs import specs

    options = _spec_options(args.option)
    if not 1 <= len(args.words) <= 2:
        raise UsageError("symattn check: error: give [SPEC] and one CLAIM (quote the formula)")
    if args.words in ([name] for name in specs()) and args.spec_file is None:
        raise UsageError(f"symattn check: error: give the CLAIM to check against {args.words[0]}")
    *named, claim = args.words
    args.spec = named[0] if named else None
    if args.spec is not None and args.spec not in specs():
        raise UsageError(f"symattn check: error: unknown spec {args.spec!r} (choose from {', '.join(specs())})")
    if (args.spec is None) == (args.spec_file is None):
        raise UsageError("symattn check: error: give either SPEC or --spec-file FILE")
    if args.spec_file is not None:
        from symattn.specs.files import load_spec_file

        target, options = load_spec_file(args.spec_file, **options), {}
    else:
        target = args.spec
    result = check(target, args.wrt, claim, trials=args.trials, seed=args.seed, **options)
    sys.stdout.write(result.text())
    return CHECK_STATUS[result.status]


CHECK_STATUS = {"right": 0, "wrong": 1, "undecided": 3}  # exit statuses of `symattn check` (docs/check.md)


def _add_check(sub: argparse._SubParsersAction) -> None:
    from symattn.derive.check import DEFAULT_TRIALS

    chk = sub.add_parser("check", help="is a claimed gradient right? (a counterexample if not)")
    chk.add_argument(
        "words",
        nargs="*",
        metavar="[SPEC] CLAIM",
        help='a built-in spec (or give --spec-file), then the claimed gradient, e.g. "X.T * P.T * G"',
    )
    chk.add_argument("--spec-file", metavar="FILE", help="a Python file defining `spec` (a user's own spec)")
    chk.add_argument("--wrt", required=True, metavar="NAME", help="an input, weight or intermediate (S, A, P, O, ...)")
    chk.add_argument("--option", action="append", metavar="KEY=VALUE", help="a spec option, e.g. scale=1")
    chk.add_argument("--seed", type=int, default=0, help="seed of the random test points (default 0)")
    chk.add_argument(
        "--trials", type=int, default=DEFAULT_TRIALS, help=f"random test points (default {DEFAULT_TRIALS})"
    )
    chk.set_defaults(handler=cmd_check)


def build_parser() -> argparse.ArgumentParser:
    from symattn.version import __version__

    parser = _Parser(prog="symattn", description="Derive, print and generate attention gradients.")
    parser.add_argument("--version", action="version", version=f"symattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("list", help="the built-in specs, one line each").set_defaults(handler=cmd_list)
    _add_derive(sub)
    _add_check(sub)
    _add_generate(sub)
    _add_graph(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    Bad input is one line on stderr and exit 2; Ctrl-C is one line and exit 130; a closed or
    full stdout ends the run quietly with exit 1 (there is no one left to read a message).
    """
    if sys.stdout is None:  # started with stdout closed
        return 1
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and isinstance(getattr(args, "words", None), list) and not any(e.startswith("-") for e in extra):
            args.words += extra  # `check SPEC --wrt W CLAIM`: positionals on both sides of an option
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        status = args.handler(args)
        sys.stdout.flush()  # a full or closed pipe shows here, inside the handlers below
        return status
    except SymattnError as err:
        print(f"symattn: error: {err}" if not isinstance(err, UsageError) else f"{err}", file=sys.stderr)
        return 2
    except RecursionError:
        print("symattn: error: the expression nests too deeply for symattn (Python's recursion limit)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("symattn: interrupted", file=sys.stderr)
        return 130
    except OSError as err:
        if err.errno not in (errno.EPIPE, errno.ENOSPC, errno.EBADF):
            raise
        _silence_stdout()
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that Python's own flush at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
