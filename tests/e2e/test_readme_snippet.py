"""README's OpenAI SDK example, as written there, against ``pagedkv serve --http-port`` serving the built-in model
``make serve`` serves: it prints an answer that names Paris, as the command-line example above it does."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pagedkv.cli import free_port
from pagedkv.local_server import LocalServer
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"  # the Makefile's MODEL: the example names it
README_BASE_URL = "http://127.0.0.1:8000/v1"


def openai_snippet() -> str:
    """The README's first Python block that makes an ``openai`` client of the gateway on port 8000."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [b for b in blocks if "from openai import OpenAI" in b and README_BASE_URL in b]
    assert found, f"README.md has no ```python block with an OpenAI client of {README_BASE_URL}"
    return found[0]


def test_snippet_is_greedy_and_bounded() -> None:
    code = openai_snippet()
    assert "temperature=0" in code and "max_tokens=" in code and f'model="{MODEL}"' in code


def test_readme_openai_snippet_answers_paris(smollm2_dir, tmp_path) -> None:
    http_port = free_port()
    server = LocalServer("--model", MODEL, "--http-port", str(http_port), "--threads", "1")
    try:
        script = tmp_path / "snippet.py"
        script.write_text(openai_snippet().replace(README_BASE_URL, f"http://127.0.0.1:{http_port}/v1"))
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout, out.stdout
    finally:
        assert server.stop() == 0, server.log()
