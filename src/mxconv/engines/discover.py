"""Find the engines' own MoE kernels and a GPU that runs them.

Two kernel sources (docs/real-kernels.md):

* **triton_kernels** (pure Python + Triton; ``matmul_ogs``, routing, the Hopper MX layouts). Looked
  for, in order: an explicit ``path`` argument (``verify --triton-kernels``, the loader's
  :class:`~mxconv.experts.kernel_settings.KernelLocations`); the folder named by ``$MXCONV_TRITON_KERNELS``;
  ``import triton_kernels`` (a site-packages install, what vLLM itself imports first); vLLM's
  vendored copy ``vllm/third_party/triton_kernels`` of an installed vLLM. A folder given by path
  or env var is the one that *contains* ``triton_kernels/``.
* **vLLM's compiled MoE ops** (``torch.ops._moe_C.moe_wna16_marlin_gemm`` and
  ``moe_align_block_size``). Looked for, in order: an explicit ``path`` argument (``verify
  --marlin-ops``, ``KernelLocations``); the ``.so`` named by ``$MXCONV_MARLIN_OPS``; ops already
  registered in this process; the ``_moe_C*.so`` of an installed vLLM.

The environment is read through :mod:`mxconv.environment`.

Anything missing raises :class:`mxconv.errors.BadInput` (exit 2) with a message that names what is
missing and how to provide it. torch, triton and vLLM are imported only when a function here runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from mxconv.environment import MARLIN_OPS_ENV, TRITON_KERNELS_ENV, marlin_ops_file, triton_kernels_dir
from mxconv.errors import BadInput

# The triton_kernels call sequence mxconv runs is the "3.5.1" API (matmul_ogs + routing module),
# whose Hopper value layout is generation "3.5" of docs/layout-triton.md.
SUPPORTED_TRITON_GENERATION = "3.5"
HOPPER = (9, 0)
MARLIN_MIN_CAPABILITY = (8, 0)  # Marlin MXFP4 W4A16 (validated on SM90 only)
MARLIN_OPS = ("moe_wna16_marlin_gemm", "moe_align_block_size")

_HOW_TRITON = (
    f"install triton_kernels (pip), install vLLM (its vllm/third_party/triton_kernels), or name the folder "
    f"that contains triton_kernels/ (e.g. extracted from the vLLM 0.33 wheel) with --triton-kernels DIR or "
    f"{TRITON_KERNELS_ENV}"
)
_HOW_MARLIN = (
    f"install vLLM (its compiled _moe_C ops), or name vLLM's _moe_C_stable_libtorch.abi3.so (from the "
    f"vLLM 0.33 wheel) with --marlin-ops FILE or {MARLIN_OPS_ENV}"
)


@dataclass(frozen=True)
class TritonKernels:
    """The triton_kernels package found: its module, where it came from, its layout generation."""

    module: ModuleType
    origin: str  # "path", "site-packages", "vllm", "env"
    location: str  # folder of the package
    generation: str  # "3.5" (matmul_ogs + routing), "3.6" (matmul_ogs + SparseMatrix), "3.8" (matmul)


@dataclass(frozen=True)
class GpuInfo:
    """The CUDA device the kernels run on."""

    index: int
    name: str
    capability: tuple[int, int]

    def describe(self) -> str:
        return f"cuda:{self.index} {self.name} (capability {self.capability[0]}.{self.capability[1]})"


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def check_gpu(
    device: Any = "cuda", *, exact: tuple[int, int] | None = HOPPER, minimum: tuple[int, int] | None = None, what: str = "the engine kernel"
) -> GpuInfo:
    """The CUDA device ``device`` if it has capability ``exact`` (or at least ``minimum``), else BadInput
    saying what was found (no CUDA build, no device, or its name and capability)."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda
        found = f"torch {torch.__version__} built without CUDA" if not built else f"torch CUDA {built} but no visible CUDA device"
        need = f"capability {exact[0]}.{exact[1]} (Hopper, SM90)" if exact else f"capability >= {minimum[0]}.{minimum[1]}" if minimum else "a CUDA GPU"
        raise BadInput(f"{what} needs a CUDA GPU with {need}; found none ({found})")
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if dev.type != "cuda":
        raise BadInput(f"{what} runs on a CUDA device, not {device!r}")
    if index >= torch.cuda.device_count():
        raise BadInput(f"{what}: no CUDA device {index} (found {torch.cuda.device_count()})")
    cap = tuple(torch.cuda.get_device_capability(index))
    info = GpuInfo(index, torch.cuda.get_device_name(index), (int(cap[0]), int(cap[1])))
    if exact is not None and info.capability != exact:
        raise BadInput(
            f"{what} needs an SM{exact[0]}{exact[1]} GPU (capability {exact[0]}.{exact[1]}, Hopper: H100/H200/H20); "
            f"found {info.describe()}"
        )
    if minimum is not None and info.capability < minimum:
        raise BadInput(f"{what} needs capability >= {minimum[0]}.{minimum[1]}; found {info.describe()}")
    return info


# ---------------------------------------------------------------------------------------------
# triton_kernels
# ---------------------------------------------------------------------------------------------

_TRITON_CACHE: dict[str, TritonKernels] = {}


def _generation(module: ModuleType) -> str:
    """Layout generation of an imported triton_kernels (docs/layout-triton.md §0)."""
    has = lambda name: importlib.util.find_spec(f"{module.__name__}.{name}") is not None  # noqa: E731
    if not has("matmul_ogs"):
        return "3.8" if has("matmul") else "unknown"
    tensor = importlib.import_module(f"{module.__name__}.tensor")
    if hasattr(tensor, "SparseMatrix"):
        return "3.6"
    return "3.5" if has("routing") else "unknown"


def _import_from(folder: Path, origin: str, source: str) -> TritonKernels:
    """Import ``triton_kernels`` from ``folder`` (which contains triton_kernels/)."""
    pkg = folder / "triton_kernels"
    if not (pkg / "__init__.py").is_file():
        raise BadInput(f"{source} = {folder}: no triton_kernels/ package in that folder; {_HOW_TRITON}")
    loaded = sys.modules.get("triton_kernels")
    if loaded is not None:
        where = Path(getattr(loaded, "__file__", "") or "").resolve().parent
        if where != pkg.resolve():
            raise BadInput(
                f"{source} = {folder}: another triton_kernels is imported already ({where}); use that one "
                "or start a fresh process"
            )
    else:
        sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module("triton_kernels")
    except Exception as exc:  # import errors of the package itself (triton missing, API drift)
        raise BadInput(f"{source} = {folder}: cannot import triton_kernels ({type(exc).__name__}: {exc})") from None
    return TritonKernels(module, origin, str(pkg), _generation(module))


def _installed_triton_kernels() -> TritonKernels:
    """triton_kernels from site-packages, else vLLM's vendored copy; BadInput when neither exists."""
    if importlib.util.find_spec("triton_kernels") is not None:
        try:
            module = importlib.import_module("triton_kernels")
        except Exception as exc:
            raise BadInput(f"the installed triton_kernels does not import ({type(exc).__name__}: {exc}); {_HOW_TRITON}") from None
        location = str(Path(module.__file__ or "").parent)
        origin = "vllm" if "third_party" in location else "site-packages"
        return TritonKernels(module, origin, location, _generation(module))
    vllm = importlib.util.find_spec("vllm")
    for root in (vllm.submodule_search_locations or []) if vllm else []:
        if (Path(root) / "third_party" / "triton_kernels" / "__init__.py").is_file():
            return _import_from(Path(root) / "third_party", "vllm", "vLLM's vendored copy")
    raise BadInput(f"triton_kernels not found (no site-packages triton_kernels, no vLLM, ${TRITON_KERNELS_ENV} unset); {_HOW_TRITON}")


def find_triton_kernels(path: str | os.PathLike[str] | None = None) -> TritonKernels:
    """Locate and import triton_kernels: ``path``, else ``$MXCONV_TRITON_KERNELS``, else an installed
    copy (module docstring); BadInput when absent."""
    env_folder = None if path else triton_kernels_dir()
    folder = Path(path).expanduser().resolve() if path else env_folder
    key = str(folder) if folder else ""
    if key in _TRITON_CACHE:
        return _TRITON_CACHE[key]
    if path:
        found = _import_from(folder, "path", "triton_kernels path")
    elif env_folder is not None:
        found = _import_from(env_folder, "env", f"${TRITON_KERNELS_ENV}")
    else:
        found = _installed_triton_kernels()
    _TRITON_CACHE[key] = found
    return found


def require_triton_generation(tk: TritonKernels, wanted: str) -> None:
    """BadInput unless ``tk`` runs mxconv's call sequence and matches the layout ``wanted``."""
    if tk.generation != SUPPORTED_TRITON_GENERATION:
        raise BadInput(
            f"triton_kernels at {tk.location} is generation {tk.generation}; mxconv runs the {SUPPORTED_TRITON_GENERATION} "
            f"generation (matmul_ogs + routing, vendored by vLLM 0.12-0.33): point KernelLocations.triton_kernels or {TRITON_KERNELS_ENV} at that copy"
        )
    if wanted != tk.generation:
        raise BadInput(
            f"the output was laid out for triton_kernels generation {wanted} (manifest layout.triton_layout) but the "
            f"triton_kernels found ({tk.location}) is generation {tk.generation}; repack with RepackOptions.layout_options "
            f"triton_layout={tk.generation} or point KernelLocations.triton_kernels or {TRITON_KERNELS_ENV} at a {wanted} copy"
        )


# ---------------------------------------------------------------------------------------------
# vLLM's compiled MoE ops (Marlin)
# ---------------------------------------------------------------------------------------------

_MARLIN_LOADED: list[str] = []


def _ops_registered() -> bool:
    import torch

    try:
        ns = torch.ops._moe_C
        return all(hasattr(ns, op) for op in MARLIN_OPS)
    except (AttributeError, RuntimeError):
        return False


def _installed_vllm_libs() -> list[Path]:
    spec = importlib.util.find_spec("vllm")
    libs: list[Path] = []
    for root in (spec.submodule_search_locations or []) if spec else []:
        libs += sorted(Path(root).glob("_moe_C*.so"))
    return libs


def _load_library(lib: Path, source: str) -> str:
    import torch

    if not lib.is_file():
        raise BadInput(f"{source} = {lib}: no such file; {_HOW_MARLIN}")
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadInput(
            f"{source} = {lib}: cannot load vLLM's MoE ops ({first}); it needs a CUDA build of torch compatible with "
            f"the library (vLLM 0.33's _moe_C_stable_libtorch.abi3.so: torch >= 2.11 with CUDA)"
        ) from None
    if not _ops_registered():
        raise BadInput(f"{source} = {lib}: loaded, but it registers no _moe_C::{' / _moe_C::'.join(MARLIN_OPS)}; {_HOW_MARLIN}")
    return str(lib)


def find_marlin_ops(path: str | os.PathLike[str] | None = None) -> str:
    """Make ``torch.ops._moe_C.moe_wna16_marlin_gemm`` and ``moe_align_block_size`` available:
    ``path``, else ``$MXCONV_MARLIN_OPS``, else ops registered already, else an installed vLLM
    (module docstring); returns where they came from. BadInput when absent."""
    named, source = (Path(path).expanduser().resolve(), "Marlin ops path") if path else (marlin_ops_file(), f"${MARLIN_OPS_ENV}")
    if named is not None:
        if str(named) not in _MARLIN_LOADED:
            _load_library(named, source)
            _MARLIN_LOADED.append(str(named))
        return str(named)
    if _ops_registered():
        return _MARLIN_LOADED[0] if _MARLIN_LOADED else "torch.ops._moe_C (registered already)"
    errors: list[str] = []
    for lib in _installed_vllm_libs():
        try:
            return _load_library(lib, "installed vLLM")
        except BadInput as exc:
            errors.append(str(exc))
    tried = f" ({'; '.join(errors)})" if errors else " (no installed vLLM, $" + MARLIN_OPS_ENV + " unset)"
    raise BadInput(f"vLLM's compiled Marlin MoE ops (_moe_C::moe_wna16_marlin_gemm) not found{tried}; {_HOW_MARLIN}")
