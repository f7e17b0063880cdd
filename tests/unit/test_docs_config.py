"""docs/configuration.md is what ``python -m pagedkv.docs_config`` renders from the argparse definitions now."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv import docs_config
from pagedkv.help_format import options, subcommands

pytestmark = pytest.mark.unit

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_committed_page_is_up_to_date() -> None:
    assert PAGE.read_text() == docs_config.render(), \
        f"docs/configuration.md is out of date with the flags: run `{docs_config.COMMAND}` and commit it"


def test_page_lists_every_option_of_every_command() -> None:
    page = PAGE.read_text()
    parser = docs_config._parser()
    for name, sub in subcommands(parser):
        section = page.split(f"\n## pagedkv {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in options(sub):
            assert f"`{action.option_strings[0]}" in section, (name, action.option_strings)


def test_environment_does_not_change_the_page(monkeypatch: pytest.MonkeyPatch) -> None:
    before = docs_config.render()
    monkeypatch.setenv("PAGEDKV_ADDRESS", "10.1.2.3:9")
    monkeypatch.setenv("PAGEDKV_API_KEY", "sk-not-for-the-docs")
    monkeypatch.setenv("DYN_NAMESPACE", "elsewhere")
    monkeypatch.setenv("COLUMNS", "57")
    after = docs_config.render()
    assert after == before and "sk-not-for-the-docs" not in after and "10.1.2.3" not in after


def test_markdown_escapes_what_would_render_as_html_or_emphasis() -> None:
    assert docs_config._markdown("a <tool_call> *b* | c") == "a &lt;tool\\_call&gt; \\*b\\* \\| c"
