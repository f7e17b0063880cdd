"""docs/configuration.md, generated from the argparse definitions of every ``pagedkv`` command:

    python -m pagedkv.docs_config > docs/configuration.md

Each option is listed with the help text --help prints (pagedkv.help_format: its default stated). Defaults read
from the environment ($PAGEDKV_ADDRESS, $DYN_NAMESPACE, ...) are rendered as if none of those were set, so the
page is the same on every machine; tests/unit/test_docs_config.py fails when the committed page is out of date.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from unittest import mock

from pagedkv import help_format

ENV_PREFIXES = ("PAGEDKV_", "DYN_")  # variables some defaults come from; left out while the page is rendered
COMMAND = "python -m pagedkv.docs_config > docs/configuration.md"
HEADER = f"""# Configuration

Every option of every `pagedkv` command, with its default and units: the same text as `--help`, generated from
the argparse definitions by `{COMMAND}` (a unit test fails when this page is out of date: run that after
changing a flag). Flags follow vLLM's names where vLLM has the same setting. `pagedkv serve` takes every
scheduler and executor option (it passes each on to the child it belongs to) and lists the common ones first.
"""


def _parser() -> argparse.ArgumentParser:
    from pagedkv.cli import build_parser

    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIXES)}
    with mock.patch.dict(os.environ, clean, clear=True):
        return build_parser()


def _markdown(text: str) -> str:
    """One line of help as Markdown text: no HTML read into ``<tool_call>``, no emphasis from ``*`` or ``_``."""
    text = " ".join(text.split())
    for char, escaped in (("\\", "\\\\"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*"), ("_", "\\_"), ("|", "\\|")):
        text = text.replace(char, escaped)
    return text


def _invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return ", ".join(f"`{flag}`" for flag in action.option_strings) if action.nargs == 0 else \
        ", ".join(f"`{flag} {formatter._format_args(action, formatter._get_default_metavar_for_optional(action))}`"
                  for flag in action.option_strings)


def _options(parser: argparse.ArgumentParser) -> Iterator[str]:
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        yield f"\n### {group.title}\n"
        for action in actions:
            text = formatter._expand_help(action) if action.help or action.option_strings else ""
            name = _invocation(parser, action) if action.option_strings else f"`{action.metavar or action.dest}`"
            yield f"- {name}" + (f" — {_markdown(text)}" if text else "")


def render() -> str:
    """The whole page."""
    parser = _parser()
    helps = {a.dest: a.help for sub in parser._actions if isinstance(sub, argparse._SubParsersAction)
             for a in sub._choices_actions}
    lines = [HEADER, "Commands: " + ", ".join(f"[`{name}`](#pagedkv-{name})"
                                            for name, _ in help_format.subcommands(parser)) + "."]
    for name, sub in help_format.subcommands(parser):
        lines += [f"\n## pagedkv {name}\n", _markdown(helps.get(name) or "")]
        lines += list(_options(sub))
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
