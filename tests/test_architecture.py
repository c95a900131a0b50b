"""The package's shape is enforced, not described (docs/architecture.md): the import-linter layers
of pyproject.toml, no import cycle (in-function imports included), backends that do not import each
other and backend names only where backends live (both from the layout registry: support/architecture.py),
small modules and functions, few top-level modules, the environment read in one module (which only reads it), no
getattr/hasattr probing of a backend layout outside layouts/."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from support.architecture import PKG, ROOT, backend_modules, backend_names_spelled, checked_backend_names, \
    cross_backend_imports, form_mismatches, signature_mismatches, weight_format_branches
from support.architecture import imported as _imported
from support.architecture import modules as _modules

BACKEND_PACKAGES = ("layouts", "engines", "kernels", "integrations")  # where a backend's name may be spelled
ENVIRONMENT_MODULE = "mxconv.environment"
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_TOP_LEVEL_MODULES = 400, 80, 12


def test_import_linter_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    r = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and "0 broken" in r.stdout, r.stdout[-4000:]


def test_no_import_cycle() -> None:
    graph = {name: _imported(name, path, tree) for name, (path, tree) in _modules().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles (in-function imports count): {cycles}"


def test_modules_and_functions_are_small() -> None:
    too_long = []
    for name, (path, tree) in _modules().items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name} (line {node.lineno}): {size} lines")
    assert not too_long, too_long


MAX_PARAMETERS = 8  # self/cls not counted; a longer list is a typed object waiting to be named
# Outside kernels/ (a Triton kernel's arguments are its launch contract) and the Typer commands (one
# parameter per flag). Each entry here is a known debt, to be paid by grouping its arguments:
PARAMETER_DEBT: set[str] = set()


def _parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [p.arg for p in (a.vararg, a.kwarg) if p]
    return len(names) - (1 if names and names[0] in ("self", "cls") else 0)


def _is_command(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Typer command: decorated with ``app.command(...)``."""
    return any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
               for d in fn.decorator_list)


def _long_signatures(module: str, tree: ast.Module) -> list[tuple[str, int]]:
    """(qualified name, parameter count) of every function of ``tree`` with more than MAX_PARAMETERS."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = _parameter_count(child)
                if count > MAX_PARAMETERS and not (module.startswith("mxconv.cli") and _is_command(child)):
                    found.append((f"{module}:{prefix}{child.name}", count))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_functions_take_few_parameters() -> None:
    """No function outside kernels/ and the Typer commands takes more than MAX_PARAMETERS parameters;
    the debt list holds only functions that still do."""
    found = {name: count for module, (_, tree) in _modules().items() if not module.startswith("mxconv.kernels")
             for name, count in _long_signatures(module, tree)}
    new = {name: count for name, count in found.items() if name not in PARAMETER_DEBT}
    assert not new, f"more than {MAX_PARAMETERS} parameters (group them into a typed, frozen object): {new}"
    assert not PARAMETER_DEBT - set(found), f"paid off: remove from PARAMETER_DEBT: {sorted(PARAMETER_DEBT - set(found))}"


def test_the_parameter_check_can_fail() -> None:
    wide = "def f(a, b, c, d, e, f, g, h, *, i): pass\nclass C:\n    def m(self, a, b, c, d, e, f, g, h, i): pass\n"
    assert [n for n, _ in _long_signatures("mxconv.x", ast.parse(wide))] == ["mxconv.x:f", "mxconv.x:C.m"]
    fine = "def f(self, a, b, c, d, e, f, g, h): pass\n@app.command(cls=Command)\ndef cmd(a, b, c, d, e, f, g, h, i): pass\n"
    assert _long_signatures("mxconv.cli.x", ast.parse(fine)) == []
    assert [n for n, _ in _long_signatures("mxconv.run.x", ast.parse(fine))] == ["mxconv.run.x:cmd"]


def test_few_top_level_modules() -> None:
    top = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_the_environment_is_read_in_one_module() -> None:
    readers = set()
    for name, (_, tree) in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.add(name)
    assert readers <= {ENVIRONMENT_MODULE}, sorted(readers - {ENVIRONMENT_MODULE})


def test_the_environment_module_only_reads_it() -> None:
    """mxconv.environment holds functions that read variables and their names, no types: a setting that
    the environment only defaults (KernelLocations) lives with the settings (mxconv.experts)."""
    _, tree = _modules()[ENVIRONMENT_MODULE]
    kinds = {type(node).__name__ for node in tree.body} - {"Expr", "ImportFrom", "Import", "Assign", "FunctionDef"}
    assert not kinds, f"{ENVIRONMENT_MODULE} defines more than readers of the environment: {sorted(kinds)}"


# Modules that may index a manifest's JSON: the typed Manifest's own (parse, schema), and the
# lenient read of an OLD output's manifest that only narrows what --overwrite removes (a damaged
# manifest there must still name its files; output.ownership).
MANIFEST_JSON_MODULES = {"mxconv.source.manifest", "mxconv.source.manifest_schema", "mxconv.output.ownership"}


def _indexes_a_manifest(node: ast.AST) -> bool:
    """``manifest[...]``, ``manifest.get(...)``, ``x.manifest[...]``, ``load_manifest(...)[...]``."""
    def is_manifest(v: ast.AST) -> bool:
        return (isinstance(v, ast.Name) and v.id == "manifest") or (isinstance(v, ast.Attribute) and v.attr == "manifest") \
            or (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "load_manifest")
    if isinstance(node, ast.Subscript):
        return is_manifest(node.value)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
        and is_manifest(node.func.value)


def test_only_the_manifest_module_indexes_manifest_json() -> None:
    """Every reader takes the typed Manifest (mxconv.source.manifest); nothing else indexes its JSON."""
    found = [f"{name}:{node.lineno}" for name, (_, tree) in _modules().items() if name not in MANIFEST_JSON_MODULES
             for node in ast.walk(tree) if _indexes_a_manifest(node)]
    assert not found, found


def test_the_manifest_check_can_fail() -> None:
    for bad in ('manifest["kind"]', 'manifest.get("tp_size")', 'src.manifest["layout"]', 'load_manifest(root)["layers"]'):
        assert any(_indexes_a_manifest(n) for n in ast.walk(ast.parse(bad))), bad
    assert not any(_indexes_a_manifest(n) for n in ast.walk(ast.parse("manifest.layout.option_values")))


def _reads_layout_json(node: ast.AST) -> bool:
    """``x.extra`` (a part's untyped keys), ``x.to_json()``, ``x.json_value(...)``, ``spec.layout[...]``."""
    if isinstance(node, ast.Attribute) and node.attr == "extra":
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("to_json", "json_value"):
        return True
    return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "layout"


def test_engines_read_the_layout_part_typed() -> None:
    """The engine runners and loaders take the typed LayoutPart: its fields as attributes, a backend's own keys
    through that backend's LayoutDescription (mxconv.layouts.description); none turns it back into JSON."""
    engines = {name: tree for name, (_, tree) in _modules().items() if name.startswith("mxconv.engines.")}
    assert "mxconv.engines.triton_moe" in engines
    found = [f"{name}:{node.lineno}" for name, tree in engines.items() for node in ast.walk(tree) if _reads_layout_json(node)]
    assert not found, found
    for bad in ('spec.layout["w13_row_order"]', 'lay.extra.get("activation")', "manifest.layout.to_json()", 'lay.json_value("arch")'):
        assert any(_reads_layout_json(n) for n in ast.walk(ast.parse(bad))), bad
    assert not any(_reads_layout_json(n) for n in ast.walk(ast.parse("TritonDescription.from_layout(spec.layout).arch")))


def test_backend_names_only_where_backends_live() -> None:
    """No string that is a registered backend's name (compared, listed, defaulted) outside
    layouts/engines/kernels/integrations."""
    assert {"trtllm", "marlin", "humming", "flashinfer-cutlass"} <= checked_backend_names()
    assert not (spelled := backend_names_spelled(BACKEND_PACKAGES)), spelled


def test_backends_do_not_import_each_other() -> None:
    """No chain of imports (in-function ones and shared modules included) leads from one registered backend's
    modules to another's; the modules of each come from the registry (support/architecture.py), so a new
    backend is checked from its registry line on."""
    groups = backend_modules()
    assert {"mxconv.layouts.humming", "mxconv.layouts.humming_int4", "mxconv.engines.humming_moe"} <= groups["humming"]
    assert "mxconv.layouts.flashinfer_cutlass_bytemap" in groups["flashinfer-cutlass"]
    assert not any(groups["cutlass"] & mods for name, mods in groups.items() if name != "cutlass")
    assert not (found := cross_backend_imports(groups)), found


def test_the_independence_check_can_fail() -> None:
    groups = backend_modules()
    merged = {**groups, "marlin": groups["marlin"] | {"mxconv.experts.padding"}}  # a module every backend imports
    found = cross_backend_imports(merged)
    assert "mxconv.layouts.cpu -> mxconv.layouts.padded_stack -> mxconv.experts.padding (backend marlin)" in found  # indirect
    assert any(chain.startswith("mxconv.layouts.trtllm") and chain.endswith("(backend marlin)") for chain in found)


# Known departures from the Layout protocol's signatures, (backend, method) -> why; each is a debt to pay.
SIGNATURE_DEBT: dict[tuple[str, str], str] = {}


def test_every_layout_has_the_protocols_signatures() -> None:
    """padded_sizes, kernel_unavailable and every other method of the Layout protocol take the same
    parameters (names, order, kinds, defaults) on every registered backend: one signature each."""
    assert not (found := signature_mismatches(SIGNATURE_DEBT)), found
    owed = {tuple(m.split(":")[0].split(".", 1)) for m in signature_mismatches({})}
    assert set(SIGNATURE_DEBT) <= owed, f"paid off: remove from SIGNATURE_DEBT: {sorted(set(SIGNATURE_DEBT) - owed)}"


def test_every_weight_form_has_the_protocols_members() -> None:
    """A layout of several weight formats declares them as WeightForm objects (layouts/forms.py): each has
    every member of the protocol, one signature per method, and is declared under its own format."""
    assert not (found := form_mismatches()), found


def test_backends_declare_forms_instead_of_branching() -> None:
    """No backend module compares a weight format: FormsLayout picks the declared form once per call."""
    assert not (found := weight_format_branches(backend_modules())), found


def test_the_form_checks_can_fail() -> None:
    from mxconv.layouts import get_layout
    from mxconv.layouts.marlin import MarlinMxfp4

    class Short(MarlinMxfp4):
        def stack_choices(self, c: object) -> dict[str, str]:  # one parameter short
            return {}

    tree = ast.parse("def padded_sizes(self, sizes, weight_format):\n    if sizes.weight_format == 'mxfp8':\n        pass\n")
    groups = {"toy": frozenset({"mxconv.layouts.toy"})}
    from support import architecture
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(architecture, "modules", lambda: {"mxconv.layouts.toy": (PKG / "layouts" / "toy.py", tree)})
        assert weight_format_branches(groups) == ["mxconv.layouts.toy:2"]
        mp.setitem(type(get_layout("marlin")).weight_forms, "mxfp8", Short())  # an MXFP4 form under mxfp8
        found = form_mismatches()
    assert "marlin.mxfp8 (Short): declared for mxfp8 but takes mxfp4" in found, found
    assert "marlin.mxfp8 (Short).stack_choices: ['c'] != the protocol's ['c', 'options']" in found, found


# Members every layout has (the Layout protocol, LayoutBase's defaults) that are not also everyday
# attribute names: a getattr/hasattr naming one of them probes a backend, whatever the object is called.
_GENERIC_NAMES = {"name", "version", "options"}


@cache
def _layout_members() -> frozenset[str]:
    from mxconv.layouts.base import Layout, LayoutBase

    names = set(Layout.__annotations__) | set(vars(Layout)) | set(vars(LayoutBase))
    return frozenset(n for n in names if not n.startswith("_")) - _GENERIC_NAMES


def _probes_a_layout(node: ast.AST) -> bool:
    """``getattr(layout, ...)``, ``hasattr(trtllm_layout, ...)``, ``getattr(get_layout(b), ...)``, or a
    getattr/hasattr of any object naming a layout member (``getattr(x, "float_to_kernel", None)``). An
    attribute named ``layout`` is not taken for one: ``manifest.layout`` is the manifest's layout table."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            and node.args):
        return False
    obj, attr = node.args[0], node.args[1] if len(node.args) > 1 else None
    func = obj.func if isinstance(obj, ast.Call) else None
    looks_like_layout = (
        (isinstance(obj, ast.Name) and obj.id.endswith("layout"))
        or (isinstance(func, ast.Name) and func.id == "get_layout")
        or (isinstance(func, ast.Attribute) and func.attr == "get_layout")
    )
    names_a_member = isinstance(attr, ast.Constant) and attr.value in _layout_members()
    return looks_like_layout or names_a_member


def test_no_probing_of_backend_layouts() -> None:
    """Outside layouts/, a backend's capabilities are read as the declared members of the Layout protocol
    (LayoutBase gives each its default), never probed with getattr/hasattr."""
    found = [f"{name}:{node.lineno}" for name, (_, tree) in _modules().items() if name.split(".")[1:2] != ["layouts"]
             for node in ast.walk(tree) if _probes_a_layout(node)]
    assert not found, found


def test_the_probing_check_can_fail() -> None:
    for bad in ('getattr(layout, "weight_formats", ("mxfp4",))', 'getattr(get_layout(b), "engine_runner", None)',
                'hasattr(my_layout, "x")', 'getattr(backend_obj, "float_to_kernel", None)',
                'hasattr(layouts.get_layout(n), "tp_refusal")'):
        assert any(_probes_a_layout(n) for n in ast.walk(ast.parse(bad))), bad
    for good in ('getattr(c, f"{w}_scale")', 'getattr(module, "quant_method", None)', 'layout.weight_formats',
                 'getattr(info, "name")', 'getattr(manifest.layout, key)'):
        assert not any(_probes_a_layout(n) for n in ast.walk(ast.parse(good))), good


@pytest.mark.parametrize("bad", ["cycle", "upward"])
def test_the_checks_can_fail(tmp_path: Path, bad: str) -> None:
    """The import walk sees in-function imports, the way a cycle or an upward import hides."""
    src = "def f():\n    from mxconv.cli import app\n" if bad == "upward" else "def g():\n    import mxconv.run.plan\n"
    path = PKG / "source" / "checkpoint.py"
    tree = ast.parse(src)
    assert _imported("mxconv.source.checkpoint", path, tree) == {"mxconv.cli" if bad == "upward" else "mxconv.run.plan"}
