"""The tree scans tests/unit/test_architecture.py checks, as plain functions of a checkout's root (``ROOT``: this
one): import graphs and their cycles, imports a package may not make, file sizes, class sizes, the planner's methods.
The reach-in scan, which reads annotations, is arch_reach_ins.py's. Each takes a root so that its own test can feed
it a synthetic tree."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/support/ -> the checkout
MAX_LINES = 360
# every folder of Python this repository holds (#51: tests, benchmarks and deploy scripts too)
SIZED = ("scheduler_svc", "executor_svc", "pagedkv", "kernels_cuda", "tests", "bench", "deploy")
# protobuf stubs (pagedkv.proto_gen writes them)
GENERATED = ("pagedkv/api/", "pagedkv/executor/", "pagedkv/kvevents/", "pagedkv/reflection/")


# ---- parsing ---------------------------------------------------------------------------------------
def parse_package(root: Path, package: str) -> dict[str, ast.Module]:
    """Module name -> its syntax tree, for every file directly in ``root/package``."""
    if not (root / package).is_dir():  # (a scan of nothing finds nothing: a wrong root must not pass)
        raise FileNotFoundError(f"{root / package}: no such package")
    return {f"{package}.{p.stem}": ast.parse(p.read_text(), str(p)) for p in sorted((root / package).glob("*.py"))}


# ---- import cycles ---------------------------------------------------------------------------------
def import_graph(root: Path = ROOT, package: str = "scheduler_svc") -> dict[str, set[str]]:
    modules = parse_package(root, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, tree in modules.items():
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == package:
                    targets = [f"{package}.{a.name}" for a in node.names]
                elif node.module.startswith(package + "."):
                    targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith(package + ".")]
            graph[mod].update(t for t in targets if t in modules and t != mod)
    return graph


def import_cycles(root: Path = ROOT, package: str = "scheduler_svc") -> list[list[str]]:
    """The strongly connected groups of more than one module (each holds at least one cycle)."""
    graph = import_graph(root, package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


# ---- imports a package may not make ------------------------------------------------------------------
def _imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) for every import anywhere in a module: top level, in functions, under TYPE_CHECKING, and
    ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(
                node.args[0].value, str):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value))
    return out


def forbidden_imports(root: Path, folder: str, forbidden: tuple[str, ...]) -> list[str]:
    """``path:line: module`` for each import under ``root/folder`` (every file, subfolders too) of a package in
    ``forbidden`` or one of its modules."""
    if not (root / folder).is_dir():
        raise FileNotFoundError(f"{root / folder}: no such folder")
    found = []
    for p in sorted((root / folder).rglob("*.py")):
        for line, module in _imported_modules(ast.parse(p.read_text(), str(p))):
            if module.split(".")[0] in forbidden:
                found.append(f"{p.relative_to(root).as_posix()}:{line}: {module}")
    return found


# ---- sizes -----------------------------------------------------------------------------------------
def long_files(root: Path = ROOT, limit: int = MAX_LINES) -> list[tuple[int, str]]:
    out = []
    for package in SIZED:
        if not (root / package).is_dir():
            raise FileNotFoundError(f"{root / package}: no such package")
        for p in sorted((root / package).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if rel.startswith(GENERATED):
                continue
            n = len(p.read_text().splitlines())
            if n > limit:
                out.append((n, rel))
    return sorted(out, reverse=True)


def class_methods(root: Path = ROOT, package: str = "scheduler_svc") -> list[tuple[int, str]]:
    """(methods, ``module.Class``) for every class in the package (nested ones too), most first: the functions
    defined in its body (properties, static and class methods included)."""
    out = []
    for mod, tree in parse_package(root, package).items():
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            n = sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in cls.body)
            out.append((n, f"{mod}.{cls.name}"))
    return sorted(out, key=lambda c: (-c[0], c[1]))


# ---- the planner -----------------------------------------------------------------------------------
def _is_forward(fn: ast.FunctionDef) -> bool:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)) or body[0].value is None:
        return False
    expr = body[0].value
    params = {a.arg for a in [*fn.args.args, *fn.args.kwonlyargs]} - {"self"}
    if isinstance(expr, ast.Call):
        args = [*expr.args, *(k.value for k in expr.keywords)]
        if not all(isinstance(a, ast.Name) and (a.id in params or a.id == "self") for a in args):
            return False
        target = expr.func
    else:
        target = expr
    # self.x.y(...) / self.x.y, or module.f(self, ...)
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute):
        return isinstance(target.value.value, ast.Name) and target.value.value.id == "self"
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id != "self":
        return isinstance(expr, ast.Call) and any(isinstance(a, ast.Name) and a.id == "self" for a in expr.args)
    return False


def planner_methods(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(every method of Scheduler, the one-line forwards among them)."""
    tree = ast.parse((root / "scheduler_svc" / "scheduler.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [m.name for m in methods], [m.name for m in methods if _is_forward(m)]
