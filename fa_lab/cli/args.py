"""The command line's argument types, one parser per kind of value, shared by every command:
numbers, result names, devices, booleans (``fa_lab.checks.parse_bool``), policy lists,
upstream versions, and ``--import`` of a user's policy file."""

from __future__ import annotations

import argparse

from fa_lab import results
from fa_lab.checks import parse_bool


#: the exit status after Ctrl-C (128 + SIGINT), as a shell reports it
INTERRUPTED = 130


class UsageError(Exception):
    """A bad flag value found after parsing; ``fa_lab.cli.main`` prints it as the command's
    one-line error and exits with status 2."""


def _int_at_least(lo: int, what: str, hi: int | None = None):
    def parse(text) -> int:
        try:
            x = int(str(text).strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if x < lo or (hi is not None and x > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {x}")
        return x
    parse.__name__ = what
    return parse


positive_int = _int_at_least(1, "a positive integer")
nonnegative_int = _int_at_least(0, "an integer >= 0")
#: torch.Generator.manual_seed takes 0 .. 2**63 - 1 here without wrapping
seed_int = _int_at_least(0, "an integer in 0 .. 2**63 - 1", hi=2**63 - 1)


def result_name(text) -> str:
    """A result file name, confined to the results directory (``fa_lab.results.check_name``)."""
    try:
        results.check_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def device_arg(text) -> str:
    """``cpu`` or ``cuda[:N]``, and a CUDA device must exist on this machine
    (``fa_lab.checks.check_device``)."""
    from fa_lab.checks import check_device

    try:
        return check_device("--device", text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_bool_flag(parser, flag: str, *, default=False, help=None, dest=None):
    """A boolean flag: ``--flag`` alone is true, ``--flag VALUE`` goes through parse_bool."""
    kw = {"dest": dest} if dest else {}
    parser.add_argument(flag, nargs="?", const=True, default=default, type=parse_bool,
                        metavar="BOOL", help=help, **kw)


def policy_list(text) -> tuple[str, ...]:
    """Comma-separated policy names; checked against the registry after ``--import``."""
    names = tuple(n.strip() for n in str(text).split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"empty policy name in {text!r}")
    return names


def upstream_name(text) -> str:
    from fa_lab import upstream
    if text not in upstream.VERSIONS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a FlyDSL version; choose one of "
                                         f"{', '.join(upstream.VERSIONS)}")
    return text


def import_policies(paths) -> None:
    """Import each file or module, so that the policies it registers exist."""
    import importlib
    import importlib.util
    from pathlib import Path

    for p in paths:
        path = Path(p)
        try:
            if path.suffix == ".py" or path.exists():
                if not path.is_file():
                    raise UsageError(f"--import {p!r}: no such file")
                spec = importlib.util.spec_from_file_location(f"fa_lab_user_{path.stem}", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            else:
                importlib.import_module(p)
        except UsageError:
            raise
        except Exception as e:  # the user's code: say where it failed, in one line
            raise UsageError(f"--import {p!r} failed: {type(e).__name__}: {e}") from None




def add_out_dir_flag(parser, what: str = "the JSON") -> None:
    """``--out-dir DIR``: the results folder (``fa_lab.results.results_dir``)."""
    parser.add_argument("--out-dir", dest="out_dir", metavar="DIR",
                        help=f"results folder for {what} (default $FA_LAB_RESULTS, else "
                             "./fa_lab_results)")


def add_import_flag(parser) -> None:
    """``--import FILE``: a user's policy file (or module), imported before the command runs."""
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE",
                        help="a Python file (or module) to import first, e.g. one that calls "
                             "fa_lab.policies.register(...); repeatable")
