#!/usr/bin/env python3
"""Pack what FlashInfer 0.7.2.post1's SM90 CUTLASS fused-MoE JIT build reads into ``.fik/`` (gitignored)
so that it travels to a GPU machine (64 MiB a call; this folder aims at <= 50 MiB).

What the build reads (flashinfer/jit/fused_moe.py ``gen_cutlass_fused_moe_module`` and
flashinfer/jit/cpp_ext.py): the sources under data/csrc/nv_internal and
data/csrc/fused_moe/cutlass_backend, kernels it generates itself (jit/gemm/cutlass/generate_kernels.py,
pure Python), and the include trees data/include, data/cutlass/{include,tools/util/include},
data/spdlog/include and data/cccl/{cub,libcudacxx/include,thrust}, and the headers directly in
data/csrc (the binding includes ../../tvm_ffi_utils.h: the first attempt on the GPU machine failed
without it). Importing flashinfer needs its
Python files and apache-tvm-ffi (a wheel, fetched with pip download). The rest of data/ (other
kernels' sources, 300+ MB) stays behind.

Usage (repo root, the venv that holds flashinfer-python):
    python scripts/fi_cutlass_kernel_pack.py            # writes .fik/flashinfer.tar.xz and .fik/*.whl
On the GPU machine (carry .fik): scripts/fi_cutlass_kernel_run.sh
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path

import flashinfer

PKG = Path(flashinfer.__file__).resolve().parent
DATA_TREES = (
    "data/csrc/nv_internal",
    "data/csrc/fused_moe/cutlass_backend",
    "data/include",
    "data/cutlass/include",
    "data/cutlass/tools/util/include",
    "data/spdlog/include",
    "data/cccl/cub",
    "data/cccl/libcudacxx/include",
    "data/cccl/thrust",
)
CODE_SUFFIXES = {".py", ".json", ".txt", ".typed"}
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"
LIMIT = 50 * 2**20


def wanted(path: Path) -> bool:
    """A file of the Python package (not data/, not caches) or of one of the DATA_TREES."""
    rel = path.relative_to(PKG).as_posix()
    if "__pycache__" in rel:
        return False
    if rel.startswith("data/"):
        top_header = rel.startswith("data/csrc/") and rel.count("/") == 2 and path.suffix in (".h", ".cuh")
        return any(rel.startswith(tree + "/") for tree in DATA_TREES) or rel == "data/__init__.py" or top_header
    return path.suffix in CODE_SUFFIXES


def pack(out: Path) -> Path:
    out.mkdir(exist_ok=True)
    tar_path = out / "flashinfer.tar.xz"
    files = sorted(p for p in PKG.rglob("*") if p.is_file() and wanted(p))
    dist = next(PKG.parent.glob("flashinfer_python-*.dist-info"))
    with tarfile.open(tar_path, "w:xz", preset=9) as tar:
        for p in files:
            tar.add(p, arcname=f"flashinfer/{p.relative_to(PKG).as_posix()}")
        tar.add(dist, arcname=dist.name)
    print(f"{len(files)} files -> {tar_path} ({tar_path.stat().st_size / 2**20:.1f} MiB)")
    return tar_path


def fetch_wheels(out: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
           "-d", str(out), TVM_FFI]  # fmt: skip
    subprocess.run(cmd, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(".fik"))
    ap.add_argument("--no-wheels", action="store_true", help="skip pip download of apache-tvm-ffi")
    args = ap.parse_args()
    pack(args.out)
    if not args.no_wheels:
        fetch_wheels(args.out)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f".fik total {total / 2**20:.1f} MiB (limit {LIMIT / 2**20:.0f} MiB)")
    return 0 if total <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
