"""What a `nemo-dcr` subcommand is, and the argument types the commands share."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


def _no_arguments(p: argparse.ArgumentParser) -> None:
    pass


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, help, options and what it runs (an exit status).

    A group (`bench`) has subcommands instead of run; dest names the attribute of the parsed
    arguments that holds the subcommand chosen.
    """

    name: str
    help: str
    run: Callable[[argparse.Namespace], int | None] | None = None
    add_arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
    subcommands: tuple[Command, ...] = ()
    dest: str | None = None


def add_commands(sub: argparse._SubParsersAction, commands: tuple[Command, ...]) -> None:
    """Add each command (and, for a group, its subcommands) as a subparser, in order: the
    order is the one `--help` lists them in."""
    for c in commands:
        p = sub.add_parser(c.name, help=c.help)
        c.add_arguments(p)
        if c.subcommands:
            add_commands(p.add_subparsers(dest=c.dest, required=True), c.subcommands)
        else:
            p.set_defaults(_run=c.run)


def rates(s: str) -> list[float]:
    """A comma-separated list of change rates, each in (0, 1)."""
    try:
        out = [float(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of rates: {s!r}") from None
    if not out or any(not 0 < r < 1 for r in out):
        raise argparse.ArgumentTypeError("rates must be in (0, 1)")
    return out


def positive(s: str) -> int:
    """A positive integer; accepts 1e6 and the like."""
    v = int(float(s))
    if v <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return v


# argparse names a type that raises ValueError in its message ("invalid _positive value: 'x'"):
# the names the messages have always had.
positive.__name__ = "_positive"
rates.__name__ = "_rates"
