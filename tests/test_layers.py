"""The package's layers, as its folders show them: a module imports only its own layer and
the layers below it, at module level, inside a function or under `TYPE_CHECKING` alike (a
function-level import hides a cycle, it does not remove it). The one exception is listed
below with its reason. Read from the source with `ast`, so nothing is imported to check it.

The order is the one `docs/design/architecture.md` describes, bottom up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxwap"

# bottom up; a top-level module is a layer of its own
LAYERS = ("core", "hardware", "energy", "analysis", "runtime", "cost", "search", "calibration",
          "plans", "decide", "option_values", "options", "planning", "planner", "api", "cli",
          "__init__", "__main__")

# (importing module, imported module): why the upward import is allowed
ALLOWED = {
    ("search.pipeline_search", "options"):
        "type only: the pipelined search reads the fields of the PlanOptions record the "
        "planner hands it; the record itself checks its values against the search's "
        "constraints, so it sits above",
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts)


def _layer(module: str) -> str:
    return module.split(".")[0]


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every jaxwap module `path` imports (dotted inside the package), with its line."""
    return _imports_of(path.read_text(), _module(path))


def _imports_of(source: str, module: str) -> list[tuple[str, int]]:
    """Every jaxwap module the source of `module` imports, with its line."""
    here = module.split(".")[:-1]       # the package this module sits in
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "jaxwap":
                target = node.module.split(".")[1:]
            else:
                continue
            names = [a.name for a in node.names]
            for name in names:          # `from jaxwap.x import module` names a module
                sub = PACKAGE.joinpath(*target, f"{name}.py")
                found.append((".".join(target + [name]) if sub.exists()
                              else ".".join(target), node.lineno))
        elif isinstance(node, ast.Import):
            found += [(".".join(a.name.split(".")[1:]), node.lineno) for a in node.names
                      if a.name.split(".")[0] == "jaxwap"]
    return [(t, line) for t, line in found if t]


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_sits_in_a_named_layer() -> None:
    layers = {_layer(_module(p)) for p in MODULES}
    assert layers <= set(LAYERS), sorted(layers - set(LAYERS))
    assert len(MODULES) > 60      # the walk found the package, not an empty folder


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module(p))
def test_a_module_imports_no_higher_layer(path: Path) -> None:
    me = _module(path)
    rank = LAYERS.index(_layer(me))
    upward = [f"{path.relative_to(PACKAGE)}:{line} imports {target}"
              for target, line in _imports(path)
              if LAYERS.index(_layer(target)) > rank and (me, target) not in ALLOWED]
    assert not upward, "\n".join(upward)


def test_the_allowed_upward_imports_are_type_only_and_still_needed() -> None:
    for (me, target), _why in ALLOWED.items():
        path = PACKAGE.joinpath(*me.split(".")).with_suffix(".py")
        tree = ast.parse(path.read_text())
        guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If)
                   and getattr(n.test, "id", None) == "TYPE_CHECKING"]
        inside = {t for g in guarded for n in ast.walk(g) if isinstance(n, ast.ImportFrom)
                  for t in [n.module.removeprefix("jaxwap.")] if n.module}
        assert target in inside, f"{me} -> {target} is listed as type-only but is not"


@pytest.mark.parametrize("folder", sorted(p.parent for p in PACKAGE.glob("*/__init__.py")),
                         ids=lambda p: p.name)
def test_a_subpackage_says_what_it_owns_and_exports_nothing(folder: Path) -> None:
    """Each layer's `__init__` is its docstring alone: what it owns and what it may import.
    A re-export there would shadow a module of the same name (`calibration.calibrate` the
    module, `jaxwap.calibrate` the function) and blur where a name lives; the public
    names are `jaxwap`'s own `__init__`."""
    tree = ast.parse((folder / "__init__.py").read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 20, f"{folder.name}/__init__.py needs its paragraph"
    assert all(isinstance(n, ast.Expr) for n in tree.body), \
        f"{folder.name}/__init__.py does more than say what the layer owns"


def test_the_checker_sees_an_upward_import() -> None:
    """The walk itself: function-level, relative and absolute imports of higher layers,
    and a module named in a from-import, are all found."""
    src = ("def f():\n    from ..planner import make_plan\n    from jaxwap.api import plan\n"
           "    from jaxwap.decide import verify\n")
    assert [t for t, _ in _imports_of(src, "core.records")] == [
        "planner", "api", "decide.verify"]
