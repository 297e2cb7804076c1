"""Python source read as syntax trees, never imported: the ground fingerprints stand on.

A :class:`SourceTree` is a package's directory (the installed vLLM, a release's wheel
unpacked under ``var/``, the standard library, or this repository); the helpers find
definitions in it, the names a module binds, a function's parameters, its string
literals, and a canonical form of its code that comments, docstrings, layout, line
numbers and the syntax-tree fields only newer Pythons add (``type_params``) do not
change, so that 3.11 and 3.12 read the same code the same way.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path

#: This repository's root: hsx's own source, which some fingerprints hold vLLM's against.
HSX_ROOT = Path(__file__).resolve().parents[3]
_IGNORED_FIELDS = frozenset({"type_params", "type_comment"})
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class SourceTree:
    """The ``.py`` files of ``package`` (``vllm``; "" for the standard library or a
    repository root) under ``root``, its directory; each parsed at most once."""

    def __init__(self, root: Path, package: str = "") -> None:
        self.root, self.package = root, package

    def path_of(self, module: str) -> str | None:
        """The relative path of dotted ``module`` under the root, or None if absent."""
        inner = module.removeprefix(self.package).lstrip(".") if self.package else module
        if self.package and module != self.package and not module.startswith(self.package + "."):
            return None
        base = inner.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py") if base else ("__init__.py",):
            if (self.root / candidate).is_file():
                return candidate
        return None

    def module_of(self, relative: str) -> str:
        """The dotted module of a relative path (``v1/core/x.py`` -> ``vllm.v1.core.x``)."""
        inner = relative.removesuffix(".py").removesuffix("__init__").rstrip("/")
        dotted = inner.replace("/", ".")
        return ".".join(part for part in (self.package, dotted) if part)

    def files(self) -> list[str]:
        """Every ``.py`` file's relative path, sorted."""
        return _files(self.root)

    def raw(self, relative: str) -> bytes:
        """One file's bytes, uncached: whole-tree scans read every file once."""
        return (self.root / relative).read_bytes()

    def tree(self, module: str) -> ast.Module | None:
        """The parsed ``module``, or None where it does not exist."""
        path = self.path_of(module)
        return None if path is None else parse(self.root / path)


@functools.cache
def _files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*.py"))


@functools.cache
def parse(path: Path) -> ast.Module:
    """The parsed file at ``path``, once per process."""
    return ast.parse(path.read_bytes())


def top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's or class's statements, those inside ``if``/``try`` blocks included
    (vLLM defines some names per platform, or only for type checkers)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from top_level(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                yield from top_level(handler.body)


def find(module: ast.Module, qualname: str) -> list[ast.AST]:
    """The definitions of ``Class.method`` (or a top-level name) in ``module``."""
    scopes: list[ast.AST] = [module]
    for part in qualname.split("."):
        found: list[ast.AST] = []
        for scope in scopes:
            body = getattr(scope, "body", [])
            for node in top_level(body):
                if isinstance(node, _DEFINITIONS) and node.name == part:
                    found.append(node)
        scopes = found
    return scopes


def canonical(node: object) -> str:
    """``node`` as text that ignores layout, comments, docstrings and the syntax-tree
    fields newer Pythons add."""
    if isinstance(node, ast.AST):
        parts = []
        for name in node._fields:
            if name in _IGNORED_FIELDS:
                continue
            value = getattr(node, name, None)
            if name == "body" and isinstance(value, list) and _has_docstring(node):
                value = value[1:]
            parts.append(f"{name}={canonical(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(canonical(item) for item in node) + "]"
    return repr(node)


def _has_docstring(node: ast.AST) -> bool:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module):
        return False
    first = node.body[0] if node.body else None
    return (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )


def digest_of(nodes: list[ast.AST]) -> str:
    """A short hash of ``nodes``' canonical form."""
    text = "\n".join(canonical(node) for node in nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``a, b, *, c, **`` for ``def f(a, b, *, c, **kw)`` (and for ``*args``): the
    names a caller passes by, not those of the catch-alls."""
    args = function.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg is not None or args.kwonlyargs:
        names.append("*")
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg is not None:
        names.append("**")
    return ", ".join(names)


def bound_names(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body binds: definitions, assignments, imports."""
    bound: set[str] = set()
    for node in top_level(body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Assign):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bound.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return bound


def defines(module: ast.Module, name: str) -> bool:
    """Whether ``module`` defines ``name`` (``Class.member`` as ``Names`` says)."""
    if "." not in name:
        return name in bound_names(module.body)
    owner, member = name.rsplit(".", 1)
    for cls in find(module, owner):
        if not isinstance(cls, ast.ClassDef):
            continue
        if member in bound_names(cls.body):
            return True
        if member in _self_attributes(cls):
            return True
    return False


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """The attributes its methods assign on ``self`` (``self.x = ...``)."""
    found = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                found.add(target.attr)
    return found


def literals(module: ast.Module) -> Iterator[str]:
    """Every string literal of ``module``; an f-string with ``{}`` for each value."""
    for node in ast.walk(module):
        if isinstance(node, ast.JoinedStr):
            yield "".join(
                str(part.value) if isinstance(part, ast.Constant) else "{}" for part in node.values
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def methods(cls: ast.AST) -> dict[str, str]:
    """A class's methods and their parameters (``parameters``)."""
    return {
        node.name: parameters(node)
        for node in top_level(getattr(cls, "body", []))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
