"""Every option of every ``pagedkv`` command states its default in --help, and names its unit where it has one
(pagedkv.help_format); ``pagedkv serve --help`` shows the common options first."""

from __future__ import annotations

import argparse
import re

import pytest

from pagedkv import help_format
from pagedkv.cli import build_parser

pytestmark = pytest.mark.unit

# A dest with one of these words takes a quantity with a unit: its help must name the unit.
UNIT_DEST = re.compile(r"timeout|seconds|interval|bytes|_gb$|_mb$|_ms$|mib|memory|space|wait|delay|budget")
UNIT_WORD = re.compile(r"\b(?:s|ms|seconds?|milliseconds|bytes|KiB|MiB|GiB|MB|GB|pages|tokens|steps|fraction)\b", re.I)


def _commands() -> list[tuple[str, argparse.ArgumentParser]]:
    return list(help_format.subcommands(build_parser()))


def _stated(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text ``parser``'s own formatter prints for ``action`` (argparse's %(...)s expanded)."""
    return parser._get_formatter()._get_help_string(action) % {**vars(action), "prog": "pagedkv"}


def test_every_command_is_walked() -> None:
    names = {name for name, _ in _commands()}
    assert {"serve", "scheduler", "executor", "gateway", "generate", "health", "bench"} <= names


def test_every_option_states_its_default() -> None:
    missing = [f"pagedkv {name} {a.option_strings[-1]} (default {a.default!r}): {a.help!r}"
               for name, parser in _commands() for a in help_format.options(parser)
               if not a.required and not help_format._STATES_DEFAULT.search(_stated(parser, a))]
    assert not missing, "options whose --help states no default (say what a None default means):\n" + \
        "\n".join(missing)


def test_quantities_name_their_unit() -> None:
    missing = [f"pagedkv {name} {a.option_strings[-1]}: {a.help!r}"
               for name, parser in _commands() for a in help_format.options(parser)
               if UNIT_DEST.search(a.dest) and not UNIT_WORD.search(a.help or "")]
    assert not missing, "options whose --help names no unit (s, ms, bytes, MiB, GiB, pages, tokens, steps):\n" + \
        "\n".join(missing)


def test_formatter_appends_the_default_only_where_none_is_stated() -> None:
    p = argparse.ArgumentParser(formatter_class=help_format.HelpFormatter)
    p.add_argument("--wait", type=float, default=2.5, help="seconds to wait")
    p.add_argument("--depth", type=int, default=3, help="pages deep (default: the model's)")
    p.add_argument("--fast", action="store_true", help="go fast")
    p.add_argument("--name", default="", help="a name")
    p.add_argument("--api-key", default="sk-from-the-environment", help="a key")
    p.add_argument("--threads", type=int, default=2, help="threads (0: torch's default)")
    text = " ".join(p.format_help().split())
    assert "seconds to wait (default: 2.5)" in text
    assert "pages deep (default: the model's)" in text and "the model's) (default" not in text
    assert "go fast (default: off)" in text
    assert "a name (default: none)" in text
    assert "a key (default: set)" in text and "sk-from-the-environment" not in text  # never a secret's value
    assert "threads (0: torch's default) (default: 2)" in text


def test_serve_help_shows_the_common_options_first() -> None:
    serve = dict(_commands())["serve"]
    text = serve.format_help()
    titles = [g.title for g in serve._action_groups if g._group_actions]
    assert titles[:4] == ["options", "model", "network (the public gRPC API, the OpenAI-compatible HTTP API, keys)",
                          "memory (KV cache)"]
    order = [text.index(f"\n  {flag}") for flag in ("--model", "--host", "--port", "--kv-cache-gb", "--max-num-seqs",
                                                   "--unplaced-timeout")]
    assert order == sorted(order)
    assert text.startswith("usage: pagedkv serve [-h] [--model MODEL] [--host HOST] [--port PORT]")
    # every option is still listed once, and still parses
    listed = [f for f in re.findall(r"^  (--[a-z0-9-]+)", text, re.M) if f != "--help-all"]
    assert len(listed) == len(set(listed)) == len([a for a in help_format.options(serve)])
    args = build_parser().parse_args(["serve", "--model", "tiny-llama", "--kv-cache-gb", "0.5", "--port", "1"])
    assert (args.model, args.kv_cache_gb, args.port) == ("tiny-llama", 0.5, 1)


def test_common_flags_exist() -> None:
    """A flag renamed or removed is dropped from SERVE_COMMON too (a stale name would silently vanish)."""
    serve = dict(_commands())["serve"]
    declared = {flag for a in serve._actions for flag in a.option_strings}
    optional = {"--api-key", "--chat-template", "--log-level"}  # (#48: being added beside this change)
    stale = [f for _, flags in help_format.SERVE_COMMON for f in flags if f not in declared and f not in optional]
    assert not stale


def test_serve_dash_h_shows_the_common_options_and_help_all_shows_every_one(capsys) -> None:
    """`pagedkv serve --help` was 242 lines (#48): -h/--help now lists the common groups and says how many more
    there are and where; --help-all lists every option (format_help, which docs/configuration.md renders, too)."""
    serve = dict(_commands())["serve"]
    for argv, full in ((["serve", "-h"], False), (["serve", "--help"], False), (["serve", "--help-all"], True)):
        with pytest.raises(SystemExit) as stop:
            build_parser().parse_args(argv)
        assert stop.value.code == 0
        text = capsys.readouterr().out
        listed = set(re.findall(r"^  (--[a-z0-9-]+)", text, re.M)) - {"--help-all"}
        common = {f for _, flags in help_format.SERVE_COMMON for f in flags} & {o.option_strings[0]
                                                                               for o in help_format.options(serve)}
        assert common <= listed
        if full:
            assert len(listed) == len(list(help_format.options(serve)))
        else:
            hidden = len(list(help_format.options(serve))) - len(listed)
            assert hidden > 20 and f"{hidden} more options" in " ".join(text.split())
            assert "--unplaced-timeout" not in listed and "--help-all" in text and len(text.splitlines()) < 200
    assert "--unplaced-timeout" in serve.format_help()
