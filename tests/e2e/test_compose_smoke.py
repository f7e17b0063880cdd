"""deploy/compose-smoke.sh and the compose commands of README.md and docs/deploying.md without an engine: the script
parses (bash -n), and every compose command they use, with its flags, exists in Compose v1 (Debian's docker-compose
1.29, which has no `cp`, no `up --wait`, ...), so that both v1 and v2 run them. Also the Dockerfile's promises that
need no
build: CPU torch by default, pinned as pyproject pins it, a non-root user, no anonymous volume. The script itself
runs against a real engine, outside `make test` (docs/deploying.md)."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from tests.e2e.test_compose import docker_compose_binary
from tests.support import procs

pytestmark = pytest.mark.e2e

SCRIPT = procs.ROOT / "deploy" / "compose-smoke.sh"
DOCKERFILE = procs.ROOT / "Dockerfile"
# `compose up -d ...` where a command starts (a line, `$(`, `&&`, `||`, `;`, `if`, `!`), up to a pipe, `)`, `>` etc.
COMMAND = re.compile(r"(?:^|\$\(|&&|\|\||;|\bif|\bthen|!)\s*compose ([a-z][a-z-]*)([^|;&)>\"`\n]*)")
README_COMMAND = re.compile(r"docker(?:-| )compose ([a-z][a-z-]*)([^|;&)>\"`\n]*)")


@pytest.fixture(scope="module")
def v1() -> str:
    return docker_compose_binary()


def _flags(rest: str) -> list[str]:
    """The options before the first positional argument: `-d --scale x=0` -> ["-d", "--scale"]."""
    out = []
    for token in shlex.split(rest.replace("$", "")):
        if not token.startswith("-"):
            break
        out.append(token.split("=")[0])
    return out


def _uses(text: str, pattern: re.Pattern) -> set[tuple[str, tuple[str, ...]]]:
    lines = (ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    return {(m.group(1), tuple(_flags(m.group(2)))) for ln in lines for m in pattern.finditer(ln)}


def _check_v1(binary: str, uses: set[tuple[str, tuple[str, ...]]]) -> None:
    listing = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    commands = set(re.findall(r"^\s{2}([a-z-]+)\s{2,}", listing.split("Commands:")[1], re.M))
    assert {"up", "down", "stop", "exec", "logs", "ps", "build"} <= commands, listing  # the listing was read
    for command, flags in sorted(uses):
        assert command in commands, f"`compose {command}` does not exist in Compose v1 ({binary})"
        usage = subprocess.run([binary, command, "--help"], capture_output=True, text=True, timeout=60).stdout
        options = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", usage))
        for flag in flags:
            assert flag in options, f"`compose {command} {flag}` does not exist in Compose v1:\n{usage}"


def test_smoke_script_parses():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_smoke_script_uses_only_compose_v1_commands(v1):
    uses = _uses(SCRIPT.read_text(), COMMAND)
    used = {command for command, _ in uses}
    assert {"up", "stop", "down", "exec", "logs"} <= used, uses  # the checks the issue asks for are there
    assert ("up", ("-d", "--scale")) in uses and ("down", ("-v",)) in uses
    _check_v1(v1, uses)


def test_readme_uses_only_compose_v1_commands(v1):
    docs = (procs.ROOT / "README.md").read_text() + (procs.ROOT / "docs" / "deploying.md").read_text()
    uses = _uses(docs, README_COMMAND)
    assert {"up", "exec", "build"} <= {command for command, _ in uses}, uses
    _check_v1(v1, uses)


def test_the_parser_finds_a_v2_only_command(v1):
    """The check above is not blind: `cp` (v2 only) and `up --wait` (v2 only) are refused."""
    for uses in ({("cp", ())}, {("up", ("-d", "--wait"))}):
        with pytest.raises(AssertionError, match="does not exist in Compose v1"):
            _check_v1(v1, uses)
    assert _uses('x=$(compose exec -T scheduler cat /certs/ca.pem) && compose up -d --scale executor-2=0 | tail',
                 COMMAND) == {("exec", ("-T",)), ("up", ("-d", "--scale"))}


def test_dockerfile_defaults_cpu_torch_as_pinned_and_a_non_root_user():
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S.*)$", text, re.M))
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"  # PyPI's torch is the CUDA build
    (torch_pin,) = re.findall(r'^    "(torch==[^"]+)",$', (procs.ROOT / "pyproject.toml").read_text(), re.M)
    assert args["TORCH_SPEC"].strip('"') == f"{torch_pin} --index-url ${{TORCH_INDEX_URL}}"
    assert re.search(r"^RUN .*pip install \$\{TORCH_SPEC\}", text, re.M)
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_CERT_PEM"):
        assert re.search(rf"^ARG {name}\b", text, re.M), name
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users == ["10001:10001"]  # (the Kubernetes manifests' runAsUser/runAsGroup)
    assert not re.search(r"^VOLUME\b", text, re.M)  # no anonymous volumes left behind by `run --rm`
    assert "g++" in args["COMPILER_PACKAGES"]  # the CPU kernels build at first start
