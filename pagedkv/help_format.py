"""How every ``pagedkv`` command's ``--help`` reads: each option states its default, and ``pagedkv serve`` lists
the options people set first (vLLM's order: model, network, memory, batching and parallelism), then the rest.

One place for both rules: ``apply(parser)`` sets ``HelpFormatter`` on a parser and all its subcommands and groups
serve's common options. ``pagedkv.docs_config`` renders docs/configuration.md with the same help strings.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

# A help text that says "default" states its own (often better than the value: "the model's", "$PAGEDKV_API_KEY").
# ("torch's default" names another's default, not this option's)
_STATES_DEFAULT = re.compile(
    r"\bdefault(?:\s*[:=(%$\d]|\s+(?:is|to|\$))|\(default\b|\bby default|\bthe default\b[);,]", re.I)
# Options whose value may be a secret taken from the environment: --help shows whether one is set, never the value.
_SECRET_DEST = re.compile(r"key|secret|token|password", re.I)
_OFF = "off"

# pagedkv serve: the groups shown first, in this order; flags not (or no longer) declared are skipped.
SERVE_COMMON: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("--model", "--served-model-name", "--tokenizer", "--chat-template", "--tool-call-parser", "--dtype",
               "--device")),
    ("network (the public gRPC API, the OpenAI-compatible HTTP API, keys)",
     ("--host", "--port", "--http-port", "--api-key", "--tenants-file", "--tls-cert", "--tls-key")),
    ("memory (KV cache)", ("--kv-cache-gb", "--num-pages", "--gpu-memory-utilization", "--swap-space",
                           "--max-model-len", "--block-size", "--kv-cache-dtype", "--enable-prefix-caching")),
    ("batching and parallelism", ("--max-num-seqs", "--max-num-batched-tokens", "--target-tpot-ms",
                                  "--target-ttft-ms", "--threads")),
    ("logging", ("--log-level", "--log-format")),
)
SERVE_REST_TITLE = "serve (the children's ports, metrics, the gateway's bounds)"
USAGE_FLAGS = ("--model", "--host", "--port", "--http-port")  # serve's usage line names these, then [OPTION ...]


def default_text(action: argparse.Action) -> str | None:
    """The value ``--help`` states as the default of ``action``, or None where there is none to state (a
    positional, a required option, a None default: the help text must say what happens then)."""
    if not action.option_strings or action.required or action.default is argparse.SUPPRESS:
        return None
    value = action.default
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "on" if value else _OFF
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if value else _OFF
    if isinstance(action, (argparse._CountAction,)):
        return str(value or 0)
    if value is None:
        return None
    if _SECRET_DEST.search(action.dest) and isinstance(value, str):
        return "set" if value else "none"
    if isinstance(value, bool):
        return "on" if value else _OFF
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) or "none"
    if value == "":
        return "none"
    return str(value)


def help_with_default(action: argparse.Action) -> str:
    """``action``'s help with "(default: X)" appended where the text states no default (``%`` escaped: argparse
    expands ``%(default)s`` and friends afterwards)."""
    text = action.help or ""
    if text is argparse.SUPPRESS or _STATES_DEFAULT.search(text):
        return text
    stated = default_text(action)
    if stated is None:
        return text
    suffix = f"(default: {stated.replace('%', '%%')})"
    return f"{text} {suffix}" if text else suffix


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with every option's default stated (``help_with_default``)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 28,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position, width)

    def _get_help_string(self, action: argparse.Action) -> str:
        return help_with_default(action)


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of each subcommand of ``parser``, in declaration order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The options ``parser``'s --help lists (no positionals, no -h, none suppressed)."""
    for action in parser._actions:
        if action.option_strings and action.help is not argparse.SUPPRESS \
                and not isinstance(action, argparse._HelpAction):
            yield action


def group_common(parser: argparse.ArgumentParser, common: tuple[tuple[str, tuple[str, ...]], ...],
                 rest_title: str) -> None:
    """Moves the ``common`` flags of ``parser`` into groups of their own, shown first (after -h), and titles what
    is left of the parser's own options ``rest_title``. Only --help's layout changes: parsing, the mutually
    exclusive groups and the usage rules are untouched."""
    by_flag = {flag: a for a in parser._actions for flag in a.option_strings}
    moved: list[argparse._ArgumentGroup] = []
    for title, flags in common:
        actions = [by_flag[f] for f in flags if f in by_flag]
        if not actions:
            continue
        for group in parser._action_groups:
            group._group_actions[:] = [a for a in group._group_actions if a not in actions]
        group = parser.add_argument_group(title)
        group._group_actions.extend(actions)
        moved.append(group)
    own = parser._optionals
    helps = [a for a in own._group_actions if isinstance(a, argparse._HelpAction)]
    rest = [a for a in own._group_actions if a not in helps]
    own._group_actions[:] = helps
    others = [g for g in parser._action_groups if g not in moved and g is not own]
    tail = parser.add_argument_group(rest_title)
    tail._group_actions.extend(rest)
    parser._action_groups[:] = [own, *moved, tail, *[g for g in others if g is not tail]]
    shown = [by_flag[f] for f in USAGE_FLAGS if f in by_flag]
    formatter = parser._get_formatter()
    names = " ".join(f"[{a.option_strings[0]} {formatter._format_args(a, a.dest.upper())}]"
                     if a.nargs != 0 else f"[{a.option_strings[0]}]" for a in shown)
    parser.usage = f"%(prog)s [-h] {names.replace('%', '%%')} [OPTION ...]"
    short_help(parser, moved)


class _CommonHelp(argparse._HelpAction):
    """serve's ``-h``/``--help``: its description and the common groups only, then how to see the rest (vLLM's
    ``--help`` shows a summary the same way); ``--help-all`` prints every option."""

    def __call__(self, parser: argparse.ArgumentParser, namespace, values, option_string=None) -> None:
        groups = parser._action_groups
        shown = groups[:1 + len(getattr(parser, "_common_groups", ()))]
        hidden = sum(1 for g in groups[len(shown):] for a in g._group_actions if a.help is not argparse.SUPPRESS)
        epilog = parser.epilog
        parser._action_groups = shown
        parser.epilog = (f"{hidden} more options (the children's ports and metrics, scheduler and executor tuning, "
                         f"TLS, tenants, the gateway's bounds): {parser.prog} --help-all, or docs/configuration.md")
        try:
            parser.print_help()
        finally:
            parser._action_groups, parser.epilog = groups, epilog
        parser.exit()


def short_help(parser: argparse.ArgumentParser, common: list[argparse._ArgumentGroup]) -> None:
    """Makes ``-h``/``--help`` of ``parser`` show only ``common`` (after -h), and adds ``--help-all``."""
    parser._common_groups = common
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):  # argparse's own -h/--help: same option, shorter answer
            action.__class__, action.help = _CommonHelp, "the common options and exit"
    parser.add_argument("--help-all", action="help", help="every option and exit")
    own = parser._optionals._group_actions
    own.insert(1, own.pop())  # --help-all right after -h


def apply(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Sets ``HelpFormatter`` on ``parser`` and every subcommand, and groups ``pagedkv serve``'s options."""
    parser.formatter_class = HelpFormatter
    for name, sub in subcommands(parser):
        apply(sub)
        if name == "serve":
            group_common(sub, SERVE_COMMON, SERVE_REST_TITLE)
    return parser
