"""A flag's dependencies, declared beside the flag: a flag that does nothing in the mode given is refused.

    needs(parser.add_argument("--top-p", ...), "--temperature", lambda args: args.temperature is not None)

After parsing, `python -m trainer` asks `unmet(parser, args)` of the command's parser and exits 2 with every flag
given whose dependency does not hold, each named with what it needs (`--top-p does nothing without --temperature
...`). A flag is given when its value is not its default, so a flag whose default could also be typed (1.0) has
the default None and its command fills it in. One mechanism for every parser: a flag added tomorrow declares its
dependency where it is added, and nothing else changes.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

ATTRIBUTE = "trainer_needs"


@dataclass(frozen=True)
class Need:
    what: str                                     # what the flag needs, in the words of the error
    holds: Callable[[argparse.Namespace], bool]   # does the parsed command line have it?


def needs(action: argparse.Action, what: str, holds: Callable[[argparse.Namespace], bool]) -> argparse.Action:
    """Declare that `action`'s flag does something only when `holds(args)`; returns the action."""
    setattr(action, ATTRIBUTE, Need(what, holds))
    return action


def unmet(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Every flag given on the command line whose declared dependency does not hold."""
    problems = []
    for action in parser._actions:
        need = getattr(action, ATTRIBUTE, None)
        if need is None or getattr(args, action.dest, action.default) == action.default or need.holds(args):
            continue
        problems.append(f"{'/'.join(action.option_strings) or action.metavar or action.dest} does nothing without {need.what}; leave "
                        f"the flag out, or give what it needs")
    return problems
