"""``fa-lab``: the lab's command line (``USAGE``).

Each command is a module of this package with ``HELP``, ``add_arguments(parser)`` and
``run(args) -> exit status``, registered by its name in ``COMMANDS``; the shared argument
types are in ``args``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .args import INTERRUPTED, UsageError

PROG = "fa-lab"
#: The commands, in the order ``fa-lab --help`` lists them: one module each.
COMMANDS = ("table", "sweep", "attack", "bench", "show", "lab")
USAGE = """\
    fa-lab table  [--which bf16|fp8|both] [--full] [--device cuda] [--B .. --S .. --H ..]
    fa-lab sweep  GRID.yaml [--workers 2] [--import FILE]
    fa-lab attack POLICY [--budget 60] [--mods bias,alibi,sink] [--import FILE]
    fa-lab attack VERSION|mla_decode [--space decode_swa|paged_fp8|..] [--p-headroom H]
    fa-lab bench  [--suite dense,splitk,varlen] [--shapes 0,1,..] [--impls a,b,..]
    fa-lab show   [NAME] [--reference] [--columns a,b,..]  list the results, or print one
    fa-lab lab    [--port N] [--no-browser]  JupyterLab on notebooks/ (pip install 'fa_lab[lab]')

Results go to the results folder: --out-dir DIR, else $FA_LAB_RESULTS, else
./fa_lab_results (JSON as <name>.json, sweeps as atlas/<name>/); the lab's reference data
in data/ is never written unless --out-dir names it.

Boolean flags take an optional value: --causal alone means true, and --causal false
(true/false, 1/0, yes/no, on/off, any case) sets it. Every error is one line and exit
status 2; Ctrl-C exits with status 130. FA_LAB_TRACEBACK=1 shows the traceback of an error
the library raised.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with errors on one line: ``fa-lab table: error: argument --S: ...``."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class CliError(SystemExit):
    """Exit status 2 once the one-line message is on stderr, as argparse's errors do;
    ``str()`` is that message (so a caller of ``main`` can read it)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self):
        return self.message


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for name in COMMANDS:
        cmd = importlib.import_module(f"{__name__}.{name}")
        sp = sub.add_parser(name, help=cmd.HELP, description=cmd.HELP)
        cmd.add_arguments(sp)
        sp.set_defaults(_run=cmd.run)
    return p


def _backend_unavailable():
    """flydsl's "cannot run here" error (a RuntimeError): a refused --backend, not a bug."""
    try:
        from fa_lab.flydsl import BackendUnavailable
    except ImportError:  # pragma: no cover
        return ValueError
    return BackendUnavailable


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _fail(message: str):
    print(message, file=sys.stderr, flush=True)
    raise CliError(message) from None


def main(argv=None) -> int:
    """Run the CLI; returns the exit status. A bad value raises ``SystemExit(2)`` after a
    one-line message on stderr: argparse's for a value it parses, ``fa-lab <cmd>: error:``
    for one checked after parsing, ``fa-lab: error:`` for one the library refuses."""
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except UsageError as e:
        _fail(f"{PROG} {args.cmd}: error: {_one_line(e)}")
    except (ValueError, TypeError, NotImplementedError, OSError, _backend_unavailable()) as e:
        # a value the library refuses (its message names the argument), or a file that
        # cannot be read or written (the message names it): no traceback
        # (FA_LAB_TRACEBACK=1 shows it, for debugging the library itself)
        if os.environ.get("FA_LAB_TRACEBACK"):
            raise
        _fail(f"{PROG}: error: {_one_line(e)}")
    except KeyboardInterrupt:
        print(f"\n{PROG} {args.cmd}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
