"""`python -m trainer <command>`: the commands are listed, with their purpose, example and doc page, in
trainer/commands.py.

Each command is a pair of functions in its module, `<command>_arguments(parser)` and
`<command>(args) -> int` (dashes become underscores); this file only dispatches and turns user errors into a message on stderr and a non-zero exit (no traceback).

Only the chosen command's module is imported (the others are listed by their help text alone), so a light command
(`show`, `plan`, `lint`, `--help`, ...) does not pay for the imports of a heavy one (torch, DeepSpeed, datasets).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading

from . import flag_needs, jit_env, numbers, paths
from .commands import COMMANDS, FIRST_READ, SUMMARY, listing, subparser_options
from .errors import UserError


PASSTHROUGH = ("launch",)  # commands that take `-- ARGS`


def build_parser(only: str | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The command line and the command modules: every command's flags, or with `only`, that command's flags and
    the other commands by name and help text (their modules are not imported)."""
    parser = argparse.ArgumentParser(prog="python -m trainer", description=f"{SUMMARY}.",
                                     epilog=f"python -m trainer <command> --help: its flags, an example and the page "
                                            f"to read. First read: {FIRST_READ}.")
    # `deepspeed --module trainer <command>` puts --local_rank=N before the command
    parser.add_argument("--local_rank", "--local-rank", type=numbers.RANK, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, command in COMMANDS.items():
        command_parser = sub.add_parser(name, **subparser_options(name))
        if only in (None, name):
            modules[name] = importlib.import_module(command.module)  # a module that fails to import is a bug: say so
            getattr(modules[name], f"{name.replace('-', '_')}_arguments")(command_parser)
    return parser, modules


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = command_word(argv)
    if command == "launch":  # its signal handlers come first, before the heavy imports below
        from .launch.signals import GUARD
        GUARD.install()
    try:
        return run(argv)
    except KeyboardInterrupt:  # Ctrl-C, during the imports too: what was written is whole (outputs are atomic)
        print(f"\n{command or 'trainer'}: interrupted (Ctrl-C); nothing half-written was left", file=sys.stderr)
        return 130


def run(argv: list[str]) -> int:
    if not argv:  # `python -m trainer` alone: what there is to run, one line each
        sys.stdout.write(listing())
        return 0
    # argparse's command is the first command word: the only other top-level flag (--local_rank) takes a number
    command = command_word(argv) or ""
    with interrupts_after_imports(command != "launch"):  # launch's own handlers take every signal from the start
        parser, modules = build_parser(only=command)
    cut = argv.index("--") if "--" in argv else len(argv)  # `launch P -- --resume auto`: passed on to the ranks
    try:  # a bad flag is argparse's exit 2 (usage + "error: argument --flag: ..."), returned like any other
        args = parser.parse_args(argv[:cut])
        args.passthrough = argv[cut + 1:]
        if args.passthrough and args.command not in PASSTHROUGH:
            parser.error(f"arguments after `--` ({' '.join(args.passthrough)}): only {', '.join(PASSTHROUGH)} "
                         f"takes them")
        command_parser = subcommands(parser)[args.command]
        clash = paths.check_distinct(command_parser, args)
        if clash:
            command_parser.error(clash)
        useless = flag_needs.unmet(command_parser, args)
        if useless:
            command_parser.error("; ".join(useless))
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 2
    try:
        return int(getattr(modules[args.command], args.command.replace("-", "_"))(args) or 0)
    except UserError as err:
        # one write: print() writes the text and its newline separately, and ranks that fail together then
        # interleave their lines ("error: a...error: a...\n\n")
        sys.stderr.write(f"error: {err}\n")
        sys.stderr.flush()
        return 2


@contextlib.contextmanager
def interrupts_after_imports(defer: bool = True):
    """A Ctrl-C while Python imports the command's modules is acted on once the imports are done. Raised inside an
    import, KeyboardInterrupt can leave an extension half-initialised (numpy then refuses to load again: the
    command died with an ImportError traceback instead of exit 130). A second Ctrl-C during the imports ends the
    process at once, with the same line and exit code."""
    if not defer or threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def note(signum, frame):
        if received:
            print("\ntrainer: interrupted (Ctrl-C); nothing half-written was left", file=sys.stderr, flush=True)
            os._exit(130)
        received.append(signum)

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def command_word(argv: list[str]) -> str | None:
    """The command argparse will find: the first known command word before `--`."""
    cut = argv.index("--") if "--" in argv else len(argv)
    return next((word for word in argv[:cut] if word in COMMANDS), None)


if __name__ == "__main__":
    jit_env.resolve_interpreter()  # a virtualenv reached through a symlink: run as its real path, before any op loads
    sys.exit(main())
