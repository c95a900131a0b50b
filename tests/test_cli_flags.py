"""Library errors speak settings, the CLI speaks flags, and one table maps one onto the other
(``mxconv.cli.flags``): no flag spelled in a library error, every setting a library message names
known to the table, every flag in the table one the CLI declares."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import typer.main

from mxconv.cli import common
from mxconv.cli.flags import SETTING_FLAGS, in_cli_words
from mxconv.errors import BadInput
from mxconv.run.conversion import RunSettings
from mxconv.run.options import QuantOptions
from support.checkpoints import make_checkpoint
from support.cli import mx

SRC = Path(__file__).resolve().parent.parent / "src" / "mxconv"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
SETTING = re.compile(r"\b(?:QuantOptions|RepackOptions|RunSettings|MemoryBudget|VerifyOptions|KernelLocations)\.[a-z_]+\b")
# Flags of other programs that library messages may name: pip's and vLLM's.
FOREIGN_FLAGS = {"--no-deps", "--load-format"}
ERROR_CALLS = {"BadInput", "LayoutError", "Unsupported", "OutputDamaged", "MxconvError"}
# A whole command a message suggests ("mxconv repack ... --tp 2") is a command, not a setting.
COMMAND = re.compile(r"mxconv (?:quantize|repack|verify|inspect|demo)\b[^;)\"]*")
# Being rewritten in other branches of this change (verify's pipeline, the layout variants).
PENDING: tuple[str, ...] = ()


# Functions whose returned text the library's callers print as a reason: why an engine kernel cannot run,
# why a layout or vLLM refuses, what would work instead (repack's and inspect's weight-format hint).
REASON_FUNCTIONS = re.compile(r"kernel_unavailable|.*_refusal|.*_hint")
# Module constants quoted as a reason (xpu's MXFP4_REFUSAL).
REASON_CONSTANTS = re.compile(r"[A-Z0-9_]*_REFUSALS?")


def _reason_texts(tree: ast.Module) -> list[ast.AST]:
    """The return values of :data:`REASON_FUNCTIONS` and the values of :data:`REASON_CONSTANTS` in ``tree``."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and REASON_FUNCTIONS.fullmatch(node.name):
            found += [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value is not None]
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and REASON_CONSTANTS.fullmatch(t.id) for t in node.targets):
            found.append(node.value)
    return found


def _library_error_texts() -> list[tuple[str, int, str]]:
    """(file, line, source text) of every raise, error construction and reason text outside cli/."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if "cli" in path.relative_to(SRC).parts[:1]:
            continue
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            call = node.exc if isinstance(node, ast.Raise) else node
            name = getattr(getattr(call, "func", None), "id", None) or getattr(getattr(call, "func", None), "attr", None)
            if isinstance(node, ast.Raise) or (isinstance(node, ast.Call) and name in ERROR_CALLS):
                found.append((str(path.relative_to(SRC)), node.lineno, ast.get_source_segment(text, node) or ""))
        found += [(str(path.relative_to(SRC)), n.lineno, ast.get_source_segment(text, n) or "") for n in _reason_texts(tree)]
    return found


def test_no_library_error_spells_a_cli_flag() -> None:
    bad = sorted({f"{f}:{line}: {sorted(flags)}" for f, line, t in _library_error_texts() if not f.startswith(PENDING)
                  for flags in [set(FLAG.findall(COMMAND.sub("", t))) - FOREIGN_FLAGS] if flags})
    assert not bad, "library errors name settings, not flags:\n" + "\n".join(bad)


def test_every_setting_named_in_the_library_has_a_flag() -> None:
    named = {m for p in SRC.rglob("*.py") if "cli" not in p.relative_to(SRC).parts[:1] for m in SETTING.findall(p.read_text())}
    named -= {"QuantOptions.selects"}  # a method, not a setting
    assert named - set(SETTING_FLAGS) == set()


def test_every_flag_in_the_table_is_declared_by_the_cli() -> None:
    from mxconv.cli import main  # noqa: F401 - registers the commands

    import mxconv.cli  # noqa: F401

    command = typer.main.get_command(common.app)
    declared = {o for sub in command.commands.values() for p in sub.params for o in getattr(p, "opts", [])}
    assert set(SETTING_FLAGS.values()) - declared == set()


@pytest.mark.parametrize(("message", "cli"), [
    ("OUTPUT x is not empty; set RunSettings.overwrite to replace its contents",
     "OUTPUT x is not empty; pass --overwrite to replace its contents"),
    ("QuantOptions.require_exact applies to QuantOptions.fmt fp8-block", "--require-exact applies to --format fp8-block"),
    ("check QuantOptions.include / QuantOptions.ignore", "check --include / --ignore"),
    ("Unset QuantOptions.require_exact to write them", "Drop --require-exact to write them"),
    ("Layout.padded_sizes stays", "Layout.padded_sizes stays"),
])
def test_in_cli_words(message: str, cli: str) -> None:
    assert in_cli_words(message) == cli


def test_same_refusal_in_python_and_on_the_command_line(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    with pytest.raises(BadInput, match=r"QuantOptions\.require_exact applies to QuantOptions\.fmt fp8-block"):
        QuantOptions("mxfp4", require_exact=True)
    code, _, err = mx("quantize", src, tmp_path / "q", "--require-exact")
    assert code == 2 and "--require-exact applies to --format fp8-block" in err and "QuantOptions" not in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, _, err = mx("quantize", src, tmp_path / "full")
    assert code == 2 and "pass --overwrite to replace its contents" in err and "RunSettings" not in err
    assert RunSettings(overwrite=True).overwrite


def test_verify_options_refuse_layers_that_are_not_numbers() -> None:
    from mxconv.verify.options import VerifyOptions

    for bad in (("a",), 3):
        with pytest.raises(BadInput, match="VerifyOptions.layers must be layer numbers"):
            VerifyOptions(layers=bad)  # type: ignore[arg-type]
    assert VerifyOptions(layers=[0, "2"]).layers == (0, 2)
