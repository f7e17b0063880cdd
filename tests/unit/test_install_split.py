"""Installs that fit the job: ``make serve`` installs pyproject.toml's dependencies only, ``make test`` adds the dev
extra to the same venv, and the runtime's dependencies are what the shipped code imports (no test tool among them,
none of its imports missing). tests/e2e/test_wheel_install.py installs the wheel and runs it."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pagedkv", "scheduler_svc", "executor_svc", "kernels_cuda")
TEST_TOOLS = {"pytest", "pytest-timeout", "hypothesis", "ruff", "openai", "litellm", "langchain-openai", "lm-eval",
              "openai-agents", "pydantic-ai", "matplotlib", "jsonschema", "kubernetes-validate", "grpcio-tools",
              "ai-dynamo", "ai-dynamo-runtime"}
# import name -> distribution, where they differ
DISTRIBUTION = {"grpc": "grpcio", "grpc_health": "grpcio-health-checking", "grpc_reflection": "grpcio-reflection",
                "google": "protobuf", "zmq": "pyzmq", "prometheus_client": "prometheus-client",
                "huggingface_hub": "huggingface-hub", "tvm_ffi": "apache-tvm-ffi"}
# Imported only by what an extra or a separate install provides, each by the command that needs it.
OUTSIDE_RUNTIME = {"xgrammar": "installed --no-deps beside the runtime (Makefile)",
                   "dynamo": "pagedkv[dynamo]", "cupy": "pagedkv[cuda]", "matplotlib": "pagedkv[bench] (plots)",
                   "grpc_tools": "make proto (the dev extra)"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _recipe(makefile: str, target: str) -> tuple[str, str]:
    """(prerequisites, recipe) of a Makefile rule."""
    match = re.search(rf"^{re.escape(target)}:([^\n]*)\n((?:\t[^\n]*\n)*)", makefile, re.M)
    assert match, f"Makefile has no rule {target}"
    return match.group(1), match.group(2)


def test_runtime_dependencies_hold_no_test_tool() -> None:
    runtime = {_name(r) for r in _project()["dependencies"]}
    dev = {_name(r) for r in _project()["optional-dependencies"]["dev"]}
    assert not runtime & TEST_TOOLS, runtime & TEST_TOOLS
    assert {"pytest", "hypothesis", "ruff"} <= dev


def test_make_serve_installs_the_runtime_and_make_test_adds_the_dev_extra() -> None:
    makefile = (ROOT / "Makefile").read_text()
    prereq, runtime = _recipe(makefile, "$(VENV)/.installed")
    assert "pip install -q -e .\n" in runtime and "[dev" not in runtime and "torch==2.13.0" in runtime
    prereq, dev = _recipe(makefile, "$(VENV)/.installed-dev")
    assert "$(VENV)/.installed" in prereq.split()  # the same venv, runtime first
    assert "-m venv" not in dev and "'.[dev]'" in dev
    assert _recipe(makefile, "serve")[0].split() == ["install"]
    assert "install-dev" in _recipe(makefile, "test")[0].split()
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # CI runs what README says


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_runtime_import_is_a_declared_dependency() -> None:
    declared = {_name(r) for r in _project()["dependencies"]}
    missing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _imports(path) - set(sys.stdlib_module_names) - set(PACKAGES) - set(OUTSIDE_RUNTIME):
                if DISTRIBUTION.get(name, name).lower().replace("_", "-") not in declared:
                    missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "imported by the shipped code but not in pyproject.toml's dependencies:\n" + \
        "\n".join(missing)
