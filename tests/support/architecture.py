"""The import walk of the package and the backend checks built on the layout registry.

tests/test_architecture.py checks the package's shape with these; tests/test_extension.py runs the
backend checks again with a toy backend registered at test time, which they pick up with no edit:
which modules make up a backend, and which names are backend names, come from the registry
(:mod:`mxconv.layouts`), never from a list kept here or in pyproject.toml.

A backend's modules: the module its registry entry names (its layout), the modules beside that one
named after it (``<module>_*``: byte maps, variants, other weight formats) and its engine runner's
module (``Layout.engine_runner``), with the modules beside that one named after it.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "mxconv"
# Backend names that are also everyday words the whole package uses: "cpu" is the device too.
NAMES_ALSO_WORDS = {"cpu"}

Module = tuple[Path, ast.Module]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Module]:
    """Every module of the package, parsed: {dotted name: (path, tree)}."""
    return {module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PKG.rglob("*.py"))}


def imported(name: str, path: Path, tree: ast.Module, known: dict[str, Module] | None = None) -> set[str]:
    """Modules of ``known`` (default: the package) ``name`` imports anywhere in its file (functions included)."""
    known, found = known if known is not None else modules(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            # ``from pkg import name`` runs pkg's __init__ as well as the submodule ``name``
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _entry_module(entry: Any) -> str:
    """The module a registry entry or an ``engine_runner`` points into: ``"module:attribute"``, or an object."""
    return entry.split(":")[0] if isinstance(entry, str) else type(entry).__module__


def _parsed(name: str) -> Module:
    """A module outside the package (a plug-in's, a test's backend), parsed from where Python finds it."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin, f"cannot find module {name}"
    path = Path(spec.origin)
    return path, ast.parse(path.read_text(), str(path))


def backend_modules() -> dict[str, frozenset[str]]:
    """{registered backend: its modules} (the rule of this module's docstring), from the registry."""
    from mxconv.layouts import _REGISTRY, backend_names, get_layout

    heads: dict[str, list[str]] = {}
    for name in backend_names():
        runner = get_layout(name).engine_runner
        heads[name] = [_entry_module(_REGISTRY[name])] + ([] if runner is None else [_entry_module(runner)])
    owner_of = {head: name for name, hs in heads.items() for head in hs}
    groups: dict[str, set[str]] = {name: set(hs) for name, hs in heads.items()}
    for mod in modules():
        package, _, leaf = mod.rpartition(".")
        owners = [h for h in owner_of if h.rpartition(".")[0] == package and leaf.startswith(h.rpartition(".")[2] + "_")]
        if owners:  # the longest head it is named after: flashinfer_cutlass_bytemap is flashinfer_cutlass's
            groups[owner_of[max(owners, key=len)]].add(mod)
    return {name: frozenset(mods) for name, mods in groups.items()}


def import_graph(groups: dict[str, frozenset[str]]) -> dict[str, set[str]]:
    """{module: modules it imports} over the package and every backend module outside it."""
    known = dict(modules())
    known.update({m: _parsed(m) for mods in groups.values() for m in mods if m not in known})
    return {name: imported(name, path, tree, known) for name, (path, tree) in known.items()}


def cross_backend_imports(groups: dict[str, frozenset[str]] | None = None) -> list[str]:
    """Every chain of imports (in-function ones included, through any shared module) from one backend's
    modules to another's, as ``"a -> b -> c (backend X)"``; empty when the backends are independent."""
    groups = backend_modules() if groups is None else groups
    graph = import_graph(groups)
    owner = {m: name for name, mods in groups.items() for m in mods}
    found = []
    for name, mods in groups.items():
        came_from: dict[str, str | None] = {m: None for m in mods}
        todo = sorted(mods)
        while todo:
            mod = todo.pop()
            for nxt in sorted(graph.get(mod, ())):
                if nxt in came_from:
                    continue
                came_from[nxt] = mod
                if owner.get(nxt, name) != name:
                    chain, at = [nxt], mod
                    while at is not None:
                        chain.append(at)
                        at = came_from[at]
                    found.append(" -> ".join(reversed(chain)) + f" (backend {owner[nxt]})")
                else:
                    todo.append(nxt)
    return found


def checked_backend_names() -> set[str]:
    """The registered backend names a module outside the backend packages may not spell."""
    from mxconv.layouts import backend_names

    return set(backend_names()) - NAMES_ALSO_WORDS


def backend_names_spelled(outside: tuple[str, ...]) -> list[str]:
    """Every string constant that is a :func:`checked_backend_names` name, in a module of the package outside
    the packages ``outside`` names: ``"module:line 'name'"``."""
    names = checked_backend_names()
    return [f"{mod}:{node.lineno} {node.value!r}" for mod, (_, tree) in modules().items()
            if not (mod.split(".")[1:2] and mod.split(".")[1] in outside)
            for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names]


def _shape(fn: Any) -> list[tuple[str, Any, Any]]:
    """A method's parameters after ``self`` as (name, kind, default), annotations aside (a layout narrows
    ``options``' type; a method bound from a module function may call ``self`` otherwise)."""
    import inspect

    return [(p.name, p.kind, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]


def signature_mismatches(debt: dict[tuple[str, str], str]) -> list[str]:
    """``"backend.method: ..."`` for every method of the Layout protocol whose parameters (names, order, kinds,
    defaults) differ on a registered backend's layout; ``debt`` lists known ones, (backend, method) -> why."""
    from mxconv.layouts import backend_names, get_layout
    from mxconv.layouts.base import Layout

    methods = [n for n, v in vars(Layout).items() if callable(v) and not n.startswith("_")]
    found = []
    for name in backend_names():
        cls = type(get_layout(name))
        for method in methods:
            want, got = _shape(getattr(Layout, method)), _shape(getattr(cls, method))
            if want != got and (name, method) not in debt:
                found.append(f"{name}.{method}: {[p[0] for p in got]} != the protocol's {[p[0] for p in want]}")
    return found


def form_mismatches() -> list[str]:
    """``"backend.format: ..."`` for every weight form a registered layout declares (``FormsLayout.weight_forms``)
    that departs from the :class:`~mxconv.layouts.forms.WeightForm` protocol: declared under a format other than
    its own, a data member missing, or a method whose parameters (names, order, kinds, defaults) differ."""
    from mxconv.layouts import backend_names, get_layout
    from mxconv.layouts.forms import FormsLayout, WeightForm

    methods = [n for n, v in vars(WeightForm).items() if callable(v) and not n.startswith("_")]
    found = []
    for name in backend_names():
        layout = get_layout(name)
        for fmt, form in (layout.weight_forms.items() if isinstance(layout, FormsLayout) else ()):
            where = f"{name}.{fmt} ({type(form).__name__})"
            missing = [m for m in WeightForm.__annotations__ if not hasattr(form, m)]
            if missing:
                found.append(f"{where}: no {', '.join(missing)}")
            if getattr(form, "weight_format", fmt) != fmt:
                found.append(f"{where}: declared for {fmt} but takes {form.weight_format}")
            for method in methods:
                want, got = _shape(getattr(WeightForm, method)), _shape(getattr(type(form), method))
                if want != got:
                    found.append(f"{where}.{method}: {[p[0] for p in got]} != the protocol's {[p[0] for p in want]}")
    return found


def weight_format_branches(groups: dict[str, frozenset[str]]) -> list[str]:
    """``"module:line"`` of every comparison with a ``weight_format`` (a name, an attribute or a
    ``WEIGHT_FORMAT`` constant) in a backend's modules: a backend declares its forms, it does not branch."""
    def names_format(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Name) and node.id.lower() == "weight_format")
                or (isinstance(node, ast.Attribute) and node.attr.lower() == "weight_format"))

    mods = modules()
    return [f"{mod}:{node.lineno}" for group in groups.values() for mod in sorted(group) if mod in mods
            for node in ast.walk(mods[mod][1])
            if isinstance(node, ast.Compare) and any(names_format(n) for n in [node.left, *node.comparators])]
