"""Fingerprints: what hsx relies on in another project's source, read as text.

A fingerprint looks at a source tree (the installed vLLM, a vLLM wheel unpacked under
``var/``, this interpreter's standard library, or hsx itself) and returns one string,
its *observed* value: a digest of a function's code, the list of modules that bind a
name, the parameters of a function. Nothing is imported, so the same code fingerprints
the vLLM that runs here (``registry.problem_of``, before a patch is installed) and a
release that cannot run here (``canary``, reading a CUDA wheel). A fingerprint holds
the values it was ``accepted`` with, one per version it was checked on; an observed
value outside them means the target changed since hsx was last checked against it.

Digests hash the canonical form of the code (``sources.canonical``): comments,
docstrings and layout do not count.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from service.engine.vllm_patches.sources import (
    HSX_ROOT,
    SourceTree,
    bound_names,
    defines,
    digest_of,
    find,
    literals,
    methods,
    parameters,
    parse,
    top_level,
)

#: Where a fingerprint's target lives: vLLM's package, the standard library, or hsx.
Package = Literal["vllm", "python", "hsx"]

ALL_PRESENT = "all present"
ALL_MATCH = "all match"
ALL_RESOLVE = "all resolve"
ABSENT = "absent"


@dataclass(frozen=True)
class Fingerprint:
    """What one fingerprint reads (``target``, in ``package``'s tree) and the values it
    was accepted with, by the version each was checked on (vLLM's, or Python's for the
    standard library)."""

    target: str
    accepted: Mapping[str, str] = field(default_factory=dict)
    package: Package = "vllm"

    #: One line saying what is observed, for docs/vllm-coupling.md.
    describes = "?"

    def observe(self, tree: SourceTree) -> str:
        """The observed value in ``tree``."""
        raise NotImplementedError

    def holds(self, observed: str) -> bool:
        """Whether ``observed`` is one of the accepted values."""
        return observed in self.accepted.values()

    @property
    def subject(self) -> str:
        """What it reads, as docs/vllm-coupling.md names it."""
        return self.target

    @property
    def module(self) -> str:
        """The dotted module of ``target`` (``module:qualname`` or a module)."""
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1] if ":" in self.target else ""


@dataclass(frozen=True)
class Digest(Fingerprint):
    """The code of one function or class (``module:Qual.name``): any change to it."""

    describes = "digest of the code of"

    def observe(self, tree: SourceTree) -> str:
        module = tree.tree(self.module)
        nodes = find(module, self.qualname) if module is not None else []
        return digest_of(nodes) if nodes else ABSENT


@dataclass(frozen=True)
class Params(Fingerprint):
    """The parameter names of one function, in order (``*`` before keyword-only ones)."""

    describes = "parameters of"

    def observe(self, tree: SourceTree) -> str:
        module = tree.tree(self.module)
        nodes = find(module, self.qualname) if module is not None else []
        functions = [n for n in nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        return ABSENT if not functions else parameters(functions[-1])


@dataclass(frozen=True)
class Names(Fingerprint):
    """That ``module`` defines each of ``names``: top-level names, ``Class.member``
    (a method, a class attribute, or ``self.member = ...`` in one of its methods)."""

    names: tuple[str, ...] = ()
    describes = "names defined in"

    @property
    def subject(self) -> str:
        return f"{self.module}: {', '.join(self.names)}"

    def observe(self, tree: SourceTree) -> str:
        module = tree.tree(self.module)
        if module is None:
            return ABSENT
        missing = [name for name in self.names if not defines(module, name)]
        return "missing: " + ", ".join(missing) if missing else ALL_PRESENT


@dataclass(frozen=True)
class Members(Fingerprint):
    """The methods a class defines in its own body, sorted: a new hook or a removed one."""

    describes = "methods of"

    def observe(self, tree: SourceTree) -> str:
        module = tree.tree(self.module)
        classes = (
            [c for c in find(module, self.qualname) if isinstance(c, ast.ClassDef)]
            if module
            else []
        )
        if not classes:
            return ABSENT
        methods = {
            n.name
            for n in top_level(classes[0].body)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        return ", ".join(sorted(methods))


@dataclass(frozen=True)
class Binders(Fingerprint):
    """Every module of the tree that binds the name ``target`` at its top level (defines
    or imports it): each holds its own reference, which a patch must replace."""

    describes = "modules binding"

    def observe(self, tree: SourceTree) -> str:
        needle = self.target.encode()
        found = []
        for relative in tree.files():
            if needle not in tree.raw(relative):
                continue
            module = tree.module_of(relative)
            parsed = tree.tree(module)
            if parsed is not None and self.target in bound_names(parsed.body):
                found.append(module)
        return ", ".join(sorted(found)) or ABSENT


@dataclass(frozen=True)
class Calls(Fingerprint):
    """Each call of ``callee`` in ``module`` (``module:callee``, the callee as written,
    ``signal.signal``), as ``enclosing function: positional count + keywords``."""

    describes = "calls in"

    def observe(self, tree: SourceTree) -> str:
        module = tree.tree(self.module)
        if module is None:
            return ABSENT
        calls = sorted(_calls(module, self.qualname))
        return "; ".join(calls) or ABSENT


def _calls(module: ast.Module, callee: str) -> Iterator[str]:
    def visit(node: ast.AST, scope: str) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.Call) and ast.unparse(child.func) == callee:
                keywords = sorted(k.arg or "**" for k in child.keywords)
                yield f"{scope or '<module>'}: {len(child.args)}" + "".join(
                    f" +{k}" for k in keywords
                )
            yield from visit(child, inner)

    yield from visit(module, "")


@dataclass(frozen=True)
class Wording(Fingerprint):
    """The modules whose string literals hold ``target``, a message template with
    ``{}`` where vLLM formats a value in (f-strings and adjacent literals joined): the
    wording hsx's start-up errors match (``service/startup.py``)."""

    describes = "modules whose messages hold"

    @property
    def subject(self) -> str:
        return f'"{self.target.strip()}"'

    def observe(self, tree: SourceTree) -> str:
        phrase = self._phrase()
        found = []
        for relative in tree.files():
            raw = tree.raw(relative)
            if phrase.search(raw) is None:  # parse only the files that may hold it
                continue
            module = tree.module_of(relative)
            parsed = tree.tree(module)
            if parsed is not None and any(self.target in text for text in literals(parsed)):
                found.append(module)
        return ", ".join(sorted(found)) or ABSENT

    def _phrase(self) -> re.Pattern[bytes]:
        """The template's longest run of plain words, as it may be split over adjacent
        literals in source (``"... KV "`` newline ``f"cache ..."``)."""
        runs = re.findall(r"[A-Za-z]+(?: [A-Za-z]+)*", self.target)
        words = max(runs, key=lambda run: len(run.split())).split()
        between = rb"\s*(?:[\"']\s*[rRbBfFuU]{0,2}[\"']\s*)?"
        return re.compile(between.join(re.escape(word.encode()) for word in words))


@dataclass(frozen=True)
class Overrides(Fingerprint):
    """hsx's class ``hsx_class`` (``module:Class``, in this repository) against the vLLM
    classes it derives from (``target``: ``module:BaseA,BaseB``): each public method
    hsx defines must exist in one of them with the same parameters, or vLLM would never
    call it, or call it with other arguments."""

    hsx_class: str = ""
    describes = "hsx's overrides in"

    @property
    def subject(self) -> str:
        return f"{self.hsx_class} against {self.target}"

    def observe(self, tree: SourceTree) -> str:
        base_module = tree.tree(self.module)
        if base_module is None:
            return ABSENT
        base: dict[str, str] = {}
        for name in self.qualname.split(","):
            for cls in find(base_module, name.strip()):
                base |= methods(cls)
        hsx_module, hsx_name = self.hsx_class.split(":")
        ours = SourceTree(HSX_ROOT).tree(hsx_module)
        mine: dict[str, str] = {}
        for cls in find(ours, hsx_name) if ours is not None else []:
            mine |= methods(cls)
        problems = []
        for name, params in sorted(mine.items()):
            if name.startswith("_"):
                continue
            if name not in base:
                problems.append(f"{name}: not in the base")
            elif base[name] != params:
                problems.append(f"{name}({params}) vs the base's ({base[name]})")
        return "; ".join(problems) or ALL_MATCH


@dataclass(frozen=True)
class Imports(Fingerprint):
    """Every ``from vllm... import name`` (and ``import vllm...``) under hsx's package
    ``target`` (``service``): the module exists and defines the name, or has it as a
    submodule or a lazily imported attribute. The protocol models, renderer entry points
    and engine classes hsx builds on."""

    describes = "vLLM names imported under"

    def observe(self, tree: SourceTree) -> str:
        missing = sorted({ref for ref in self.references() if not _resolves(tree, *ref)})
        if not missing:
            return ALL_RESOLVE
        return "missing: " + ", ".join(f"{m}:{n}" if n else m for m, n in missing)

    def references(self) -> Iterator[tuple[str, str]]:
        """(module, name) of each import of vLLM in hsx's package; name "" for a plain
        ``import vllm.x``."""
        for path in sorted((HSX_ROOT / self.target).rglob("*.py")):
            for node in ast.walk(parse(path)):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    if node.module == "vllm" or node.module.startswith("vllm."):
                        yield from ((node.module, alias.name) for alias in node.names)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name == "vllm" or alias.name.startswith("vllm."):
                            yield alias.name, ""


def _resolves(tree: SourceTree, module: str, name: str) -> bool:
    parsed = tree.tree(module)
    if parsed is None:
        return False
    if not name or name in bound_names(parsed.body):
        return True
    if tree.path_of(f"{module}.{name}") is not None:
        return True
    # A lazy module attribute (``vllm.SamplingParams``): ``__getattr__`` and the name
    # spelled out in the module's table of them.
    return "__getattr__" in bound_names(parsed.body) and name in set(literals(parsed))
