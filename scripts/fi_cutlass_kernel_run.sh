#!/usr/bin/env bash
# On the GPU machine (repo root, `.fik` carried; made by scripts/fi_cutlass_kernel_pack.py):
# unpack FlashInfer 0.7.2.post1 with the sources of its SM90 CUTLASS fused-MoE JIT build, build that
# module into .fik/cache (kept between calls while the machine stays warm) and run the GPU tests.
set -euo pipefail
site=/tmp/fik-site
mkdir -p "$site" .fik/cache
[ -d "$site/flashinfer" ] || tar -xJf .fik/flashinfer.tar.xz -C "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .fik/*.whl
export PYTHONPATH="$site:$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_WORKSPACE_BASE="$PWD/.fik/cache" FLASHINFER_CUDA_ARCH_LIST="9.0a" MAX_JOBS="$(nproc)"
export PYTHONUNBUFFERED=1
python3 -c 'import flashinfer, torch; print("flashinfer", flashinfer.__version__, "torch", torch.__version__, torch.cuda.get_device_name())'
python3 -m pytest -q -p no:cacheprovider -x tests/test_flashinfer_cutlass_gpu.py "$@"
