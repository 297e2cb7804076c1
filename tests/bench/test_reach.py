"""What ``benchmarks/`` and ``experiments/`` may reach, read from their source (nothing
is imported or run).

``make test`` runs no bench (``make bench-smoke`` does), so a renamed hsx module would
break a bench or an experiment unseen: every module and name of ours that they import,
by statement or by a dotted string (a preload list, a connector's module path), must
exist. And the benches use hsx and vLLM through public names only: no ``_name`` of
another object or module; an experiment may (``experiments/README.md``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("service", "benchmarks", "experiments")
#: A dotted name of ours in a string; ``benchmarks.md`` and the like are files.
DOTTED = re.compile(r"(?:service|benchmarks|experiments)(?:\.\w+)+(?<!\.md)(?<!\.py)")
#: Private names of other code that benchmarks/ reads, each for want of a public one.
ALLOWED_PRIVATE = {
    # A forked job leaves without the parent's exit handlers or event loop (documented).
    "_exit",
    # ... after running its own exit handlers, as an interpreter's exit would.
    "_run_exitfuncs",
    # transformers' config has no public setter; speculators' own CLI sets it so.
    "_attn_implementation",
}


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    if base.is_dir():  # a namespace package
        return base
    return None


def defined_names(path: Path) -> set[str]:
    """Names bound at the top level of a module (definitions, assignments, imports), and
    those its ``__all__`` lists (a package may load them lazily)."""
    if path.is_dir():
        return set()
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if "__all__" in names and isinstance(node.value, ast.List | ast.Tuple):
                names.update(ast.literal_eval(node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def resolves(dotted: str) -> bool:
    """``a.b.c`` is a module of ours, or a name that module ``a.b`` defines."""
    if module_file(dotted) is not None:
        return True
    module, _, name = dotted.rpartition(".")
    found = module_file(module)
    return found is not None and name in defined_names(found)


def our_references(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every module or name of ours that ``path`` imports."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(OURS):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith(OURS):
                for alias in node.names:
                    yield node.lineno, f"{node.module}.{alias.name}"
        elif (  # a module of ours named in a string
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and DOTTED.fullmatch(node.value)
        ):
            yield node.lineno, node.value


def test_benchmarks_and_experiments_import_only_what_exists() -> None:
    broken = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for folder in ("benchmarks", "experiments")
        for path in sources(folder)
        for line, name in our_references(path)
        if not resolves(name)
    ]
    assert not broken, "imports of modules or names that do not exist:\n" + "\n".join(broken)


def test_benchmarks_reach_no_private_name_of_other_code() -> None:
    """``self._x`` of a bench's own class is its own business; ``other._x``, ``module._x``
    and ``from module import _x`` reach into code the bench does not own."""
    reaches = []
    for path in sources("benchmarks"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Attribute):
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    names = [node.attr]
            elif isinstance(node, ast.ImportFrom):
                names = [alias.name for alias in node.names]
                names += (node.module or "").split(".")
            elif isinstance(node, ast.Import):
                names = [part for alias in node.names for part in alias.name.split(".")]
            reaches += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                for name in names
                if name.startswith("_")
                and not (name.startswith("__") and name.endswith("__"))
                and name not in ALLOWED_PRIVATE
            ]
    assert not reaches, "private names reached from benchmarks/:\n" + "\n".join(reaches)


def test_the_checks_see_a_broken_import_and_a_private_reach(tmp_path: Path) -> None:
    # The checkers themselves: a renamed module, a name it no longer defines, a private read.
    assert resolves("benchmarks.common.Row")
    assert not resolves("benchmarks.common.NoSuchName")
    assert not resolves("benchmarks.no_such_module")
    probe = tmp_path / "probe.py"
    probe.write_text("from benchmarks.gone import x\nimport service.nope\nq = 'benchmarks.gone'\n")
    assert [name for _, name in our_references(probe)] == [
        "benchmarks.gone.x",
        "service.nope",
        "benchmarks.gone",
    ]
