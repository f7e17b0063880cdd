"""The reach-in scan of tests/unit/test_architecture.py (``reach_ins``): an attribute of an object whose class is
defined in another module of the package, read or written where the object's class is known from an annotation
(a parameter, ``self.<attr>``, a record's field, a container's elements, a function's return), when the attribute
is the class's data (assigned on ``self`` in its methods) or underscored; and any underscored attribute of an object
that is not ``self`` or ``cls``. Records (dataclasses, enums, NamedTuples, Protocols, exceptions) are values whose
fields are their interface."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.arch_scan import ROOT, parse_package

RECORD_BASES = {"Enum", "IntEnum", "NamedTuple", "Protocol", "Exception", "TypedDict"}


# ---- reading classes and annotations ---------------------------------------------------------------
def _imported_names(tree: ast.Module, package: str) -> dict[str, tuple[str, str]]:
    """Local name -> (module, name) for every ``from package.x import Name`` anywhere in the module."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package + "."):
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name)
    return out


def _is_record(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
                isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases}
    return bool(bases & RECORD_BASES) or any(b.endswith(("Error", "Exception")) for b in bases)


def _assigned_on_self(target: ast.expr) -> list[str]:
    """``self.x`` in an assignment target (``self.x = ...``, ``self.x[k] = ...``, ``a, self.x = ...``)."""
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return [target.attr]
    if isinstance(target, ast.Subscript):
        return _assigned_on_self(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for elt in target.elts for name in _assigned_on_self(elt)]
    return []


def _data_attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class assigns on ``self`` in its methods (its state)."""
    names = set()
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            names.update(_assigned_on_self(t))
    return names


def _record_fields(cls: ast.ClassDef) -> dict[str, set[str]]:
    """A record's annotated fields -> the class names their annotations mention."""
    return {node.target.id: _annotation_names(node.annotation) for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def _classes(modules: dict[str, ast.Module]) -> dict[tuple[str, str], ast.ClassDef]:
    return {(mod, node.name): node for mod, tree in modules.items() for node in tree.body
            if isinstance(node, ast.ClassDef)}


def _unquoted(ann: ast.expr | None) -> ast.expr | None:
    """A string annotation (``"X"``) parsed."""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            return ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return None
    return ann


def _annotation_names(ann: ast.expr | None) -> set[str]:
    """Class names an annotation mentions (``X``, ``X | None``, ``"X"``, ``list[X]`` not: only the object itself)."""
    ann = _unquoted(ann)
    if ann is None:
        return set()
    if isinstance(ann, ast.Name):
        return {ann.id}
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _annotation_names(ann.left) | _annotation_names(ann.right)
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
        return _annotation_names(ann.slice)
    return set()


def _element_names(ann: ast.expr | None) -> set[str]:
    """Class names of a container annotation's elements (``list[X]``, ``deque[X]``, ``dict[K, X]``,
    ``Mapping[K, X]``: the values)."""
    ann = _unquoted(ann)
    if isinstance(ann, ast.Subscript):
        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        return _annotation_names(elts[-1])
    return set()


# ---- the scan --------------------------------------------------------------------------------------
def reach_ins(root: Path = ROOT, package: str = "scheduler_svc") -> list[str]:
    modules = parse_package(root, package)
    classes = _classes(modules)
    stateful = {key: _data_attributes(cls) for key, cls in classes.items() if not _is_record(cls)}
    # a record's fields that hold a stateful class: (module, record) -> field -> (module, class)
    held: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}
    for (mod, name), cls in classes.items():
        if _is_record(cls):
            imported = _imported_names(modules[mod], package)
            fields = {f: next((imported.get(n) or (mod, n) for n in names
                               if (imported.get(n) or (mod, n)) in stateful), None)
                      for f, names in _record_fields(cls).items()}
            held[mod, name] = {f: k for f, k in fields.items() if k}
    # module functions that return a stateful class: (module, function) -> (module, class)
    returns: dict[tuple[str, str], tuple[str, str]] = {}
    for mod, tree in modules.items():
        imported = _imported_names(tree, package)
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef):
                for n in _annotation_names(fn.returns):
                    key = imported.get(n) or (mod, n)
                    if key in stateful:
                        returns[mod, fn.name] = key
    found = []
    for mod, tree in modules.items():
        imported = _imported_names(tree, package)

        def foreign(names: set[str], mod=mod, imported=imported) -> tuple[str, str] | None:
            for name in names:
                key = imported.get(name)
                if key is not None and key[0] != mod and key in stateful:
                    return key
            return None

        def records(names: set[str], imported=imported) -> dict[str, tuple[str, str]]:
            for name in names:
                key = imported.get(name)
                if key in held:
                    return held[key]
            return {}

        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)] + [tree]:
            typed_self = {}  # self.<attr> -> the class it holds (annotated)
            elements_self = {}  # self.<attr> -> the class of the elements it holds (a container, annotated)
            if isinstance(cls, ast.ClassDef):
                for node in ast.walk(cls):
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute) and isinstance(
                            node.target.value, ast.Name) and node.target.value.id == "self":
                        key = foreign(_annotation_names(node.annotation))
                        if key:
                            typed_self[node.target.attr] = key
                        key = foreign(_element_names(node.annotation))
                        if key:
                            elements_self[node.target.attr] = key
                    if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                        params = {a.arg: foreign(_annotation_names(a.annotation)) for a in node.args.args}
                        for stmt in ast.walk(node):
                            if not isinstance(stmt, ast.Assign):
                                continue
                            value, key = stmt.value, None
                            if isinstance(value, ast.Name):  # self.x = a parameter typed with a class
                                key = params.get(value.id)
                            elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name):  # self.x = X(...)
                                key = foreign({value.func.id})
                                made_by = imported.get(value.func.id)  # self.x = f(...), f -> another module's X
                                if key is None and made_by in returns and returns[made_by][0] != mod:
                                    key = returns[made_by]
                            for t in stmt.targets if key else ():
                                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                                        t.value.id == "self":
                                    typed_self[t.attr] = key
            body = cls.body
            for fn in [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
                typed = {a.arg: foreign(_annotation_names(a.annotation)) for a in params}
                typed = {k: v for k, v in typed.items() if v}
                elements = {a.arg: foreign(_element_names(a.annotation)) for a in params}
                for node in ast.walk(fn):  # loop variables over such containers (for x in c, c.values(), c.items())
                    if not isinstance(node, (ast.For, ast.comprehension)):
                        continue
                    it, target = node.iter, node.target
                    while (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.args
                           and it.func.id in ("sorted", "list", "reversed", "tuple", "enumerate")):
                        if it.func.id == "enumerate" and isinstance(target, ast.Tuple):
                            target = target.elts[-1]
                        it = it.args[0]
                    pairs = isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items"
                    if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in (
                            "values", "items"):
                        it = it.func.value
                    key = None
                    if isinstance(it, ast.Name):
                        key = elements.get(it.id)
                    elif isinstance(it, ast.Attribute) and isinstance(it.value, ast.Name) and it.value.id == "self":
                        key = elements_self.get(it.attr)
                    if pairs and isinstance(target, ast.Tuple):
                        target = target.elts[-1]
                    if key and isinstance(target, ast.Name):
                        typed[target.id] = key
                for node in ast.walk(fn):  # local names bound to such an object (x = self.attr, a, b = p, self.y)
                    if isinstance(node, ast.Assign) and len(node.targets) == 1:
                        target, value = node.targets[0], node.value
                        pairs = (list(zip(target.elts, value.elts)) if isinstance(target, ast.Tuple)
                                 and isinstance(value, ast.Tuple) else [(target, value)])
                        for t, v in pairs:
                            if not isinstance(t, ast.Name):
                                continue
                            if isinstance(v, ast.Name) and v.id in typed:
                                typed[t.id] = typed[v.id]
                            elif (isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name)
                                  and v.value.id == "self" and v.attr in typed_self):
                                typed[t.id] = typed_self[v.attr]
                via_record = {a.arg: records(_annotation_names(a.annotation)) for a in params}
                for node in ast.walk(fn):
                    if not isinstance(node, ast.Attribute):
                        continue
                    owner = None
                    if isinstance(node.value, ast.Name) and node.value.id in typed:
                        owner, what = typed[node.value.id], node.value.id
                    elif (isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
                          and node.value.attr in via_record.get(node.value.value.id, {})):
                        owner = via_record[node.value.value.id][node.value.attr]  # view.kv.<attr>: a record's field
                        what = f"{node.value.value.id}.{node.value.attr}"
                        if owner[0] == mod:
                            owner = None
                    elif (isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
                          and node.value.value.id == "self" and node.value.attr in typed_self):
                        owner, what = typed_self[node.value.attr], f"self.{node.value.attr}"
                    if owner is not None and (node.attr in stateful[owner] or node.attr.startswith("_")):
                        found.append(f"{mod}:{node.lineno}: {what}.{node.attr} ({owner[1]} of {owner[0]})")
                    elif (node.attr.startswith("_") and not node.attr.startswith("__")
                          and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                        found.append(f"{mod}:{node.lineno}: {ast.unparse(node)} (underscored)")
    return sorted(set(found))
