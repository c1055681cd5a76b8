"""The flag tables of docs/usage.md, generated from the argument parsers themselves.

    python scripts/docs_flags.py            # rewrite every block of docs/usage.md
    python scripts/docs_flags.py --check    # exit 1 naming each CLI whose block is stale

Each command line has one block in the file, between ``<!-- flags:NAME -->`` and
``<!-- /flags -->``: one markdown table per argument group (flag, default, help), the help text as
argparse holds it, with ``%(default)s`` and the like expanded as argparse does. The parsers are
built by the code that the programs run: ``runtime.arguments.build_parser()`` (main.py),
``preprocess_dataset.build_parser()``, and the parser that ``runtime.report.cli.parse_args`` builds
(captured when it parses, since it builds it inside that function).

Defaults that depend on where the docs are generated are made the same everywhere: the
environment variables that main.py's defaults read (``UNET3D_LOG_DIR``, ``LOCAL_RANK``) are
unset while its parser is built, a default path inside the repository is shown relative to it,
and preprocessing's ``--num_workers`` (the cores of this machine) is shown as ``N``.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

USAGE = os.path.join(ROOT, "docs", "usage.md")
END = "<!-- /flags -->"
BLOCK = re.compile(r"<!-- flags:(?P<name>[^ ]+) -->\n(?P<body>.*?)" + re.escape(END), re.DOTALL)

# Environment variables read by main.py's defaults; unset while its parser is built.
MAIN_ENV = ("UNET3D_LOG_DIR", "LOCAL_RANK")
# (CLI, dest) -> the value shown for a default that is this machine's (help and table alike).
MACHINE_DEFAULTS = {("preprocess_dataset.py", "num_workers"): "N"}


@contextmanager
def _unset(names) -> Iterator[None]:
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def main_parser() -> argparse.ArgumentParser:
    with _unset(MAIN_ENV):
        from runtime.arguments import build_parser

        return build_parser()


def preprocess_parser() -> argparse.ArgumentParser:
    import preprocess_dataset

    return preprocess_dataset.build_parser()


class _Captured(Exception):
    pass


def report_parser() -> argparse.ArgumentParser:
    """The parser ``runtime.report.cli.parse_args`` builds, taken when it starts to parse."""
    from runtime.report import cli

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        cli.parse_args([])
    except _Captured as captured:
        return captured.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    raise RuntimeError("runtime.report.cli.parse_args built no parser")


# name in the markers -> the parser's builder, in the order of docs/usage.md.
CLIS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "main.py": main_parser,
    "preprocess_dataset.py": preprocess_parser,
    "runtime.report": report_parser,
}


def _cell(text: str) -> str:
    """Table-safe markdown that renders as ``text``: `|` escaped, and `<` and `*`, which markdown
    would take for a tag (``<case>``) or emphasis."""
    text = " ".join(text.split())
    for char in "\\|<*":
        text = text.replace(char, "\\" + char)
    return text


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def _relative(value):
    if isinstance(value, str) and os.path.isabs(value) and value.startswith(ROOT + os.sep):
        return os.path.relpath(value, ROOT)
    return value


def _flag(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    if not action.option_strings:
        return _code(formatter._format_args(action, action.metavar or action.dest))
    names = ", ".join(_code(option) for option in action.option_strings)
    if action.choices is not None or action.metavar is not None:
        names += " " + _code(formatter._format_args(action, action.dest.upper()))
    return names


def _default(action: argparse.Action) -> str:
    if action.required or (not action.option_strings and action.nargs in ("+", None)):
        return "(required)"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "on" if action.default else "off"
    if action.default is argparse.SUPPRESS:
        return ""
    if action.default is None or action.default == []:
        return "none"
    if isinstance(action.default, (list, tuple)):
        return _code(" ".join(str(value) for value in action.default))
    if action.default == "":
        return "`''`"
    return _code(str(action.default))


def _help(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    if not action.help:
        return ""
    return _cell(formatter._expand_help(action))  # %(default)s, %(prog)s, %% as argparse expands them


def _group_title(group: argparse._ArgumentGroup) -> str:
    return {"options": "general", "optional arguments": "general",
            "positional arguments": "arguments"}.get(group.title, group.title)


def render(name: str, parser: argparse.ArgumentParser | None = None) -> str:
    """The block's body for CLI ``name``: a table per argument group, ``--help`` left out."""
    parser = parser if parser is not None else CLIS[name]()
    for action in parser._actions:
        if (name, action.dest) in MACHINE_DEFAULTS:
            action.default = MACHINE_DEFAULTS[name, action.dest]
        action.default = _relative(action.default)
    formatter = argparse.HelpFormatter(parser.prog)
    groups = [(group, [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)])
              for group in parser._action_groups]
    groups = [(group, actions) for group, actions in groups if actions]
    lines = []
    for group, actions in groups:
        if len(groups) > 1:
            lines += [f"**{_group_title(group)}**", ""]
        lines += ["| flag | default | help |", "| --- | --- | --- |"]
        lines += [f"| {_flag(a, formatter)} | {_default(a)} | {_help(a, formatter)} |" for a in actions]
        lines.append("")
    return "\n".join(lines)


def blocks(text: str) -> dict[str, str]:
    """The body of every flag block of ``text``, by CLI name."""
    return {match["name"]: match["body"] for match in BLOCK.finditer(text)}


def _generated(parsers: dict[str, argparse.ArgumentParser] | None) -> dict[str, str]:
    parsers = parsers or {}
    return {name: "\n" + render(name, parsers.get(name)) for name in CLIS}


def stale(text: str, parsers: dict[str, argparse.ArgumentParser] | None = None) -> list[str]:
    """The CLIs whose block in ``text`` is missing or differs from the generated one."""
    found = blocks(text)
    return [name for name, body in _generated(parsers).items() if found.get(name) != body]


def update(text: str, parsers: dict[str, argparse.ArgumentParser] | None = None) -> str:
    """``text`` with every block regenerated; a CLI without its markers is an error."""
    generated = _generated(parsers)
    missing = [name for name in generated if name not in blocks(text)]
    if missing:
        raise SystemExit(f"docs_flags.py: no <!-- flags:{missing[0]} --> ... {END} block in the file")
    return BLOCK.sub(lambda m: f"<!-- flags:{m['name']} -->\n{generated.get(m['name'], m['body'])}{END}", text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/docs_flags.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check: exit 1 naming each stale CLI")
    parser.add_argument("--file", default=USAGE, help="the markdown file holding the blocks (default: %(default)s)")
    args = parser.parse_args(argv)
    with open(args.file, encoding="utf-8") as handle:
        text = handle.read()
    if args.check:
        names = stale(text)
        for name in names:
            print(f"{os.path.relpath(args.file)}: the flag table of {name} is stale or missing; "
                  f"run python scripts/docs_flags.py", file=sys.stderr)
        return 1 if names else 0
    new = update(text)
    if new != text:
        temporary = args.file + ".tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(new)
        os.replace(temporary, args.file)
        print(f"{os.path.relpath(args.file)}: rewrote {', '.join(stale(text))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
