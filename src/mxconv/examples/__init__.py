"""Tiny real-format MoE checkpoints for ``mxconv demo`` and the README tour.

:func:`make_checkpoint` writes a small checkpoint with the exact tensor names, dtypes, orientations
and config.json keys of the real model family (see ../shared/docs/checkpoint-formats.md), sharded
with a ``model.safetensors.index.json`` like the Hub releases, plus dummy tokenizer and generation
files. It returns a :class:`GroundTruth` with the canonical expert tensors each MoE layer must read
back as (float for bf16/fp16/fp32, the stored bytes for MXFP4).

Kinds (:data:`KINDS`): "gpt-oss-mxfp4", "gpt-oss-bf16", "qwen3-moe", "qwen2-moe", "mixtral".
Sizes are a :class:`ModelSizes`; the default ones are multiples of 32 but not of 128 (backends must
pad them). Values are realistic: Gaussian weights with std 1/sqrt(fan_in), MXFP4 bytes random with scale bytes in 115..125.

The test suite adds its block-FP8, INT4, DeepSeek, GLM and Kimi kinds on the same pieces
(a :class:`KindSpec` each, :class:`Builder` subclasses; tests/support/checkpoints.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch

from mxconv.errors import BadInput
from mxconv.examples.builder import Builder, GroundTruth, LayerTruth, ModelSizes, write_shards, write_side_files
from mxconv.examples.models import GPT_OSS_HEAD_DIM, gpt_oss, mlp, per_expert_layer, qwen_mixtral

__all__ = [
    "KINDS", "Builder", "GroundTruth", "KindSpec", "LayerTruth", "ModelSizes", "make_checkpoint", "mlp",
    "per_expert_layer", "write_shards", "write_side_files",
]

# (builder, kind, sizes with every one given, **options) -> (config.json, truth per MoE layer)
Generate = Callable[..., "tuple[dict[str, Any], dict[int, LayerTruth]]"]


@dataclass(frozen=True)
class KindSpec:
    """How to generate one kind: its family, default (hidden, intermediate) sizes, generator and
    builder (from the seed)."""

    family: str
    sizes: tuple[int, int]
    generate: Generate
    builder: Callable[[int], Builder] = Builder

    def options(self) -> tuple[str, ...]:
        """The options the generator takes: its keyword parameters after (builder, kind, sizes)."""
        params = list(inspect.signature(self.generate).parameters.values())[3:]
        return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _gpt_oss(b: Builder, kind: str, sizes: ModelSizes, head_dim: int = GPT_OSS_HEAD_DIM) -> Any:
    return gpt_oss(b, kind, sizes, head_dim)


def _qwen_mixtral(b: Builder, kind: str, sizes: ModelSizes, dtype: torch.dtype = torch.bfloat16,
                  mlp_only_layers: tuple[int, ...] = ()) -> Any:  # fmt: skip
    return qwen_mixtral(b, kind, sizes, dtype, tuple(mlp_only_layers))


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
    sizes: ModelSizes = ModelSizes(),
    *,
    seed: int = 0,
    shards: int = 2,
    spec: KindSpec | None = None,
    **options: Any,
) -> GroundTruth:
    """Write a tiny checkpoint of ``kind`` (see :data:`KINDS`, or any kind ``spec`` describes) with
    ``sizes`` (hidden and intermediate left out: the kind's) into ``path`` and return its truth.

    ``options`` go to the kind's generator: ``dtype`` (qwen*, mixtral: bf16/fp16/fp32), ``mlp_only_layers``
    (Qwen: those layers dense) and ``head_dim`` (gpt-oss, default 16; vLLM's CPU attention needs 32, 64, ...)
    here. One the kind's generator does not take (a misspelling, an option of another kind) is a BadInput
    naming it, the kind and the options the kind takes, never silently dropped.
    """
    spec = spec or _SPECS.get(kind)
    if spec is None:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    misplaced = sorted(set(options) & {f.name for f in fields(ModelSizes)})
    if misplaced:  # a generator would ignore them: say where they go instead
        given = ", ".join(f"{k}={options[k]!r}" for k in misplaced)
        raise TypeError(f"make_checkpoint: {', '.join(misplaced)} belong in the sizes: "
                        f"make_checkpoint(path, {kind!r}, ModelSizes({given}))")
    unknown = sorted(set(options) - set(spec.options()))
    if unknown:
        takes = ", ".join(spec.options()) or "none"
        raise BadInput(f"make_checkpoint: kind {kind!r} takes no option {', '.join(unknown)} (its options: {takes})")
    sizes = sizes.with_defaults(*spec.sizes)
    _, E, H, I, top_k, _ = sizes.dims()
    if H % 32 or I % 32:
        raise ValueError(f"hidden_size {H} and intermediate_size {I} must be multiples of 32")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    b = spec.builder(seed)
    config, truths = spec.generate(b, kind, sizes, **options)
    write_shards(path, b.t, shards)
    write_side_files(path, config)
    return GroundTruth(
        kind=kind,
        family=spec.family,
        path=path,
        config=config,
        tensor_names=list(b.t),
        num_experts=E,
        hidden_size=H,
        intermediate_size=I,
        top_k=top_k,
        layers=truths,
    )
