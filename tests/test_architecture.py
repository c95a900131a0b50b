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


# The parts of a manifest reached through the manifest (``manifest.numerics``, ``state.plan.manifest.linears``)
# or, for ``layout``, through anything (``spec.layout``: a runner's LayerSpec carries the LayoutPart).
_PARTS = {"model", "source", "numerics", "linears", "fp8_tiles", "quant_config", "upstream"}


def _chain(node: ast.AST) -> list[str]:
    """The names of an attribute chain, root first (``state.plan.manifest.layout`` -> [state, plan, manifest, layout])."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def _is_part(node: ast.AST, aliases: frozenset[str] = frozenset()) -> bool:
    """A manifest part (``x.layout``; ``manifest.numerics``, ``(m.manifest.numerics or {})``) or a name the
    module assigned one to (``q = m.quant_config``: ``aliases``)."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
        return _is_part(node.values[0], aliases)
    names = _chain(node)
    if not names:
        return False
    if len(names) == 1 and isinstance(node, ast.Name):
        return names[0] in aliases
    rooted = any(n == "manifest" or n.endswith("_manifest") for n in names[:-1])
    return names[-1] == "layout" and len(names) > 1 or (rooted and names[-1] in _PARTS)


def _part_aliases(tree: ast.AST) -> frozenset[str]:
    """Names assigned a manifest part anywhere in ``tree`` (``q = m.quant_config``, ``lay = src.manifest.layout``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_part(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None and _is_part(node.value):
            names |= {node.target.id} if isinstance(node.target, ast.Name) else set()
    return frozenset(names)


def manifest_json_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, kind) of each place ``tree`` turns a manifest part back into JSON or indexes it: ``extra`` (a
    part's untyped keys), ``json_value`` (a key's JSON value), ``as_written`` (the JSON of the manifest or a
    part: a method name of its own, found whatever holds the part), ``index`` (``spec.layout[...]``,
    ``manifest.numerics.get(...)``, a name holding a part indexed, ``x.as_written()[...]``)."""
    found: list[tuple[int, str]] = []
    aliases = _part_aliases(tree)
    for node in ast.walk(tree):
        func = node.func if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
        if isinstance(node, ast.Attribute) and node.attr == "extra":
            found.append((node.lineno, "extra"))
        elif func is not None and func.attr in ("json_value", "as_written"):
            found.append((node.lineno, func.attr))
        got = node.value if isinstance(node, ast.Subscript) else func.value if func is not None and func.attr == "get" else None
        if got is not None and (_is_part(got, aliases) or (isinstance(got, ast.Call) and isinstance(got.func, ast.Attribute)
                                                           and got.func.attr == "as_written")):
            found.append((node.lineno, "index"))
    return found


# The modules that may turn a manifest part back into JSON, each for what and why; everywhere else a part is
# read as its typed fields (mxconv.source.manifest_parts) and a backend's own layout keys through its
# LayoutDescription (mxconv.layouts.description: TritonDescription, ..., ServingDescription).
MANIFEST_JSON_USES: dict[str, dict[str, str]] = {
    "mxconv.source.manifest_parts": {"extra": "the parts themselves: from_json, as_written, json_value",
                                     "as_written": "a part writes its sub-parts (plain_json)"},
    "mxconv.source.manifest": {"as_written": "Manifest.with_keys parses the manifest again with keys set"},
    "mxconv.layouts.description": {"extra": "LayoutDescription.from_layout: a backend's keys out of LayoutPart.extra"},
    "mxconv.output.manifest": {"as_written": "the writer: Manifest.as_written is mxconv.json"},
    "mxconv.inspect": {"as_written": "inspect's JSON document shows the manifest's layout and model as written"},
    "mxconv.verify.integrity": {"json_value": "verify compares the whole layout table with the layout's describe()"},
    "mxconv.output.engine_quant_config": {"index": "it owns the quant_config object (EngineQuantConfig)"},
}


def test_the_manifest_is_read_typed_everywhere() -> None:
    """No module outside MANIFEST_JSON_USES turns a manifest part back into JSON or indexes it (and those only
    for their named use): the engine runners, the vLLM plugin, the quant config, verify and inspect read fields."""
    found = [f"{name}:{line} ({kind})" for name, (_, tree) in _modules().items()
             for line, kind in manifest_json_reads(tree) if kind not in MANIFEST_JSON_USES.get(name, {})]
    assert not found, found
    used = {(name, kind) for name, (_, tree) in _modules().items() for _, kind in manifest_json_reads(tree)}
    unused = {(name, kind) for name, kinds in MANIFEST_JSON_USES.items() for kind in kinds} - used
    assert not unused, f"no longer used: remove from MANIFEST_JSON_USES: {sorted(unused)}"


def test_the_manifest_json_check_can_fail() -> None:
    bad = {'spec.layout["w13_row_order"]': "index", 'lay.extra.get("activation")': "extra",
           "manifest.layout.as_written()": "as_written", 'lay.json_value("arch")': "json_value",
           'manifest.layout.as_written()["arch"]': "index", '(state.plan.manifest.numerics or {}).get("upstream")': "index",
           'input_manifest.linears["targets"]': "index", "m.manifest.as_written()": "as_written",
           'manifest.quant_config.get("not_served")': "index",
           # whatever holds the part: the review's three escapes of the name-based check
           'fields = lay.as_written()\nfields["arch"]': "as_written",
           "def kernel_unavailable(self, layout):\n    d = layout.as_written()": "as_written",
           'q = m.manifest.quant_config\nq.get("served")': "index",
           'q: dict = m.manifest.quant_config\nq["served"]': "index", '(q := m.manifest.quant_config).get("served")\nq["x"]': "index"}
    for text, kind in bad.items():
        assert kind in {k for _, k in manifest_json_reads(ast.parse(text))}, text
    for good in ("TritonDescription.from_layout(spec.layout).arch", "manifest.numerics.upstream.fingerprint",
                 'manifest.tensors[key].sha256', 'manifest.layout.engine_compat.get("vllm")', "plan.linears.to_json()",
                 'rep.fp8_tiles["inexact"]', "stats.fp8_tiles.to_json()", "info.to_json()", "layout.to_json()",
                 'q = plan.quant\nq.get("x")'):
        assert not manifest_json_reads(ast.parse(good)), good


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
