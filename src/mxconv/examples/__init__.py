"""Tiny real-format MoE checkpoints for ``mxconv demo`` and the README tour.

:func:`make_checkpoint` writes a small checkpoint with the exact tensor names, dtypes, orientations
and config.json keys of the real model family (see ../shared/docs/checkpoint-formats.md), sharded
with a ``model.safetensors.index.json`` like the Hub releases, plus dummy tokenizer and generation
files. It returns a :class:`GroundTruth` with the canonical expert tensors each MoE layer must read
back as (float for bf16/fp16/fp32, the stored bytes for MXFP4).

Kinds (:data:`KINDS`): "gpt-oss-mxfp4", "gpt-oss-bf16", "qwen3-moe", "qwen2-moe", "mixtral".
Default sizes are multiples of 32 but not of 128 (backends must pad them). Values are realistic:
Gaussian weights with std 1/sqrt(fan_in), MXFP4 bytes random with scale bytes in 115..125.

The test suite adds its block-FP8, INT4, DeepSeek, GLM and Kimi kinds on the same pieces
(a :class:`KindSpec` each, :class:`Builder` subclasses; tests/support/checkpoints.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mxconv.examples.builder import Builder, GroundTruth, LayerTruth, write_shards, write_side_files
from mxconv.examples.models import GPT_OSS_HEAD_DIM, gpt_oss, mlp, per_expert_layer, qwen_mixtral

__all__ = [
    "KINDS", "Builder", "GroundTruth", "KindSpec", "LayerTruth", "make_checkpoint", "mlp", "per_expert_layer",
    "write_shards", "write_side_files",
]

# (builder, kind, L, E, H, I, top_k, V, **options) -> (config.json, truth per MoE layer)
Generate = Callable[..., "tuple[dict[str, Any], dict[int, LayerTruth]]"]


@dataclass(frozen=True)
class KindSpec:
    """How to generate one kind: its family, default (hidden, intermediate) sizes, generator and
    builder (from the seed)."""

    family: str
    sizes: tuple[int, int]
    generate: Generate
    builder: Callable[[int], Builder] = Builder


def _gpt_oss(b: Builder, kind: str, L: int, E: int, H: int, I: int, top_k: int, V: int,
            head_dim: int = GPT_OSS_HEAD_DIM, **_: Any) -> Any:  # fmt: skip
    return gpt_oss(b, kind, L, E, H, I, top_k, V, head_dim)


def _qwen_mixtral(
    b: Builder, kind: str, L: int, E: int, H: int, I: int, top_k: int, V: int,
    dtype: torch.dtype = torch.bfloat16, mlp_only_layers: tuple[int, ...] = (), **_: Any,
) -> Any:
    return qwen_mixtral(b, kind, L, E, H, I, top_k, V, dtype, tuple(mlp_only_layers))


# Default sizes: multiples of 32, not of 128.
_SPECS = {
    "gpt-oss-mxfp4": KindSpec("gpt-oss", (96, 64), _gpt_oss),
    "gpt-oss-bf16": KindSpec("gpt-oss", (96, 64), _gpt_oss),
    "qwen3-moe": KindSpec("qwen-moe", (160, 96), _qwen_mixtral),
    "qwen2-moe": KindSpec("qwen-moe", (160, 96), _qwen_mixtral),
    "mixtral": KindSpec("mixtral", (160, 96), _qwen_mixtral),
}
KINDS = tuple(_SPECS)


def make_checkpoint(
    path: str | Path,
    kind: str,
    *,
    num_layers: int = 2,
    num_experts: int = 4,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    top_k: int = 2,
    vocab_size: int = 64,
    seed: int = 0,
    shards: int = 2,
    spec: KindSpec | None = None,
    **options: Any,
) -> GroundTruth:
    """Write a tiny checkpoint of ``kind`` (see :data:`KINDS`, or any kind ``spec`` describes) into
    ``path`` and return its truth.

    ``options`` go to the kind's generator, which ignores those it has no use for: ``dtype``
    (qwen*, mixtral: bf16/fp16/fp32), ``mlp_only_layers`` (Qwen: those layers dense) and ``head_dim``
    (gpt-oss, default 16; vLLM's CPU attention needs 32, 64, ...) here.
    """
    spec = spec or _SPECS.get(kind)
    if spec is None:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    H = hidden_size or spec.sizes[0]
    I = intermediate_size or spec.sizes[1]
    if H % 32 or I % 32:
        raise ValueError(f"hidden_size {H} and intermediate_size {I} must be multiples of 32")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    b = spec.builder(seed)
    config, truths = spec.generate(b, kind, num_layers, num_experts, H, I, top_k, vocab_size, **options)
    write_shards(path, b.t, shards)
    write_side_files(path, config)
    return GroundTruth(
        kind=kind,
        family=spec.family,
        path=path,
        config=config,
        tensor_names=list(b.t),
        num_experts=num_experts,
        hidden_size=H,
        intermediate_size=I,
        top_k=top_k,
        layers=truths,
    )
