"""``python -m brcompile`` (also the ``brcompile`` command): ``explain``.

    python -m brcompile explain [flags] script.py [script args ...]

The benchmark is a script of the repository, not part of the installed package:
``python benchmarks/bench_grpo.py [flags]`` from a checkout (``python -m brcompile bench`` says so and exits
with status 2).

``explain``: runs ``script.py`` (as ``__main__``, with ``sys.argv = [script.py, *script args]``) inside
``recording()`` of brcompile/tools/explain.py: every ``torch.compile`` of the script (and ``nn.Module.compile``) that
uses the default backend or names branch_replay compiles with branch_replay instead, and every call of every
captured graph is recorded; ``torch.compile`` calls with another backend (``"eager"``, ``"aot_eager"``, a
custom one) are left alone and listed. When the script ends (also by ``sys.exit`` or an exception) the
report is printed: each graph (rewritten, or the node and reason it fell back), each call's prefix tree and,
for the first ``--measure-calls`` calls of each graph, the predicted FLOPs (dense, packed, the limit) and
the bytes saved for backward. ``torch._dynamo.optimize`` called directly is not redirected.

    python -m brcompile explain train.py --steps 3            # the report on stdout at exit
    python -m brcompile explain --json report.json --no-code train.py
    python -m brcompile explain --compiler aot_eager --dump-dir dumps train.py
"""
from __future__ import annotations

import argparse
import json
import logging
import runpy
import sys
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger(__name__)


def _explain_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--compiler", choices=("inductor", "aot_eager", "eager"), default="inductor",
                   help="how branch_replay runs the packed graphs (default inductor)")
    p.add_argument("--min-dedup", type=float, default=None, help="branch_replay's min_dedup")
    p.add_argument("--dump-dir", default=None, help="write every graph before/after as .py and .dot (+ .svg)")
    p.add_argument("--no-measure", action="store_true", help="skip the FLOP and saved-bytes measurement")
    p.add_argument("--measure-calls", type=int, default=2, help="calls measured per graph (default 2)")
    p.add_argument("--keep-default-backend", action="store_true",
                   help="only redirect torch.compile calls that name branch_replay (leave the default inductor)")
    p.add_argument("--json", type=Path, default=None, help="also write report.to_dict() here")
    p.add_argument("--no-code", action="store_true", help="leave the packed graphs' code out of the report")
    p.add_argument("--rich", choices=("auto", "yes", "no"), default="auto", help="tables with rich")
    p.add_argument("script", type=Path, help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def run_explain(args) -> int:
    """Runs the script under ``recording()`` of brcompile/tools/explain.py, prints (and writes) the report; returns the
    script's exit status."""
    import brcompile
    from brcompile.tools.explain import recording

    if not args.script.is_file():
        print(f"brcompile explain: no such script: {args.script}", file=sys.stderr)
        return 2
    options = {"compiler": args.compiler}
    if args.min_dedup is not None:
        options["min_dedup"] = args.min_dedup
    if args.dump_dir:
        options["dump_dir"] = args.dump_dir
    backend = brcompile.backend(**options)
    status = 0
    argv, path0 = sys.argv, list(sys.path)
    sys.argv = [str(args.script), *args.script_args]
    sys.path.insert(0, str(args.script.resolve().parent))  # as `python script.py` would
    with recording(backend, measure=not args.no_measure, measure_calls=args.measure_calls,
                   take_over_default=not args.keep_default_backend) as rec:
        try:
            runpy.run_path(str(args.script), run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            log.exception("brcompile explain: %s raised", args.script)
            status = 1
        finally:
            sys.argv, sys.path[:] = argv, path0
    report = rec.report()
    print(f"\n==== brcompile explain: {args.script} (exit status {status}) ====", flush=True)
    report.print(code=not args.no_code, rich={"auto": None, "yes": True, "no": False}[args.rich])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_dict(), indent=2, default=str))
        print(f"wrote {args.json}")
    return status


BENCH_MOVED = ("brcompile bench: the benchmark is a script of the repository now; run "
               "`python benchmarks/bench_grpo.py [flags]` from a checkout (--help lists the flags)")


def build_parser() -> argparse.ArgumentParser:
    """``brcompile explain``."""
    p = argparse.ArgumentParser(prog="brcompile", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    _explain_parser(sub.add_parser("explain", help="run a script with branch_replay and report at exit",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        print(BENCH_MOVED, file=sys.stderr)
        return 2
    return run_explain(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
