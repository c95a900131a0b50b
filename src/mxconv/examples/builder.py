"""The pieces every generated checkpoint is made of: what a layer must read back as
(:class:`LayerTruth`, :class:`GroundTruth`), the seeded tensor :class:`Builder`, and the writers of
the shards, index and side files (config, tokenizer, generation config) of a Hub-style release."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class ModelSizes:
    """The sizes of a generated model. ``hidden_size`` / ``intermediate_size`` None: the kind's
    defaults (multiples of 32, not of 128, so that backends must pad them)."""

    num_layers: int = 2
    num_experts: int = 4
    hidden_size: int | None = None
    intermediate_size: int | None = None
    top_k: int = 2
    vocab_size: int = 64

    def with_defaults(self, hidden_size: int, intermediate_size: int) -> ModelSizes:
        """These sizes with the ones left out (None or 0) given."""
        return replace(self, hidden_size=self.hidden_size or hidden_size,
                       intermediate_size=self.intermediate_size or intermediate_size)  # fmt: skip

    def dims(self) -> tuple[int, int, int, int, int, int]:
        """(layers, experts, hidden, intermediate, top_k, vocab) of sizes with every one given."""
        H, I = self.hidden_size, self.intermediate_size
        if H is None or I is None:
            raise ValueError("hidden_size and intermediate_size must be given (ModelSizes.with_defaults)")
        return self.num_layers, self.num_experts, H, I, self.top_k, self.vocab_size


@dataclass
class LayerTruth:
    """What one MoE layer must read back as (canonical, see mxconv.families.base)."""

    layer: int
    module_prefix: str
    row_order: str  # "interleaved" | "halves"
    expert_names: list[str]  # every source tensor the reader consumes for this layer
    router_weight: str
    router_bias: str | None = None
    correction_bias: str | None = None
    w13: torch.Tensor | None = None  # [E, 2I, H] float (source dtype; fp32 for block-FP8)
    w2: torch.Tensor | None = None  # [E, H, I]
    w13_mx: tuple[torch.Tensor, torch.Tensor] | None = None  # (data uint8 [E, 2I, H/2], scales uint8 [E, 2I, H/32])
    w2_mx: tuple[torch.Tensor, torch.Tensor] | None = None  # (data uint8 [E, H, I/2], scales uint8 [E, H, I/32])
    # INT4 kinds: (offset-binary bytes uint8 [E, 2I, H/2] = the int32 words' bytes, scales bf16 [E, 2I, H/32]);
    # w13 / w2 then hold the exact fp32 dequantization q * scale
    w13_int4: tuple[torch.Tensor, torch.Tensor] | None = None
    w2_int4: tuple[torch.Tensor, torch.Tensor] | None = None
    w13_bias: torch.Tensor | None = None  # [E, 2I] (gpt-oss)
    w2_bias: torch.Tensor | None = None  # [E, H]
    gate: torch.Tensor | None = None  # [E, I, H] float: the gate projection alone (float kinds)
    up: torch.Tensor | None = None  # [E, I, H]
    input_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # W4A8 kinds: float32 [E] of w13, w2


@dataclass
class GroundTruth:
    """A generated checkpoint and what mxconv must find in it."""

    kind: str
    family: str
    path: Path
    config: dict[str, Any]
    tensor_names: list[str]
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    layers: dict[int, LayerTruth] = field(default_factory=dict)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.layers))


class Builder:
    """Accumulates named tensors (insertion order = file order) from one seeded generator.

    The routed experts and dense MLPs of the per-expert families are written through
    :meth:`expert_linear` / :meth:`dense_linear` (plain float Linears here); a subclass stores
    them in another format (the test suite's block-FP8 and INT4 builders)."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.t: dict[str, torch.Tensor] = {}

    def randn(self, shape: tuple[int, ...], std: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.randn(shape, generator=self.g) * std).to(dtype)

    def add(self, name: str, t: torch.Tensor) -> torch.Tensor:
        assert name not in self.t, name
        self.t[name] = t.contiguous()
        return self.t[name]

    def linear(self, name: str, out: int, inp: int, dtype: torch.dtype, bias: bool = False) -> torch.Tensor:
        w = self.add(f"{name}.weight", self.randn((out, inp), inp**-0.5, dtype))
        if bias:
            self.add(f"{name}.bias", self.randn((out,), 0.02, dtype))
        return w

    def norm(self, name: str, n: int, dtype: torch.dtype) -> None:
        self.add(f"{name}.weight", (1.0 + self.randn((n,), 0.05)).to(dtype))

    def dense_linear(self, name: str, out: int, inp: int, dtype: torch.dtype, bias: bool = False) -> None:
        """A Linear of the dense (non-expert) part of a per-expert family."""
        self.linear(name, out, inp, dtype, bias=bias)

    def expert_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the canonical (read-back) expert weights."""
        return dtype

    def begin_experts(self, t: LayerTruth, E: int, H: int, I: int) -> None:
        """Called once per MoE layer before its experts are written."""

    def expert_linear(
        self, t: LayerTruth, which: str, e: int, rows: slice, name: str, out: int, inp: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """One routed expert's Linear ``name``: rows ``rows`` of expert ``e`` of ``which`` ("w13" or
        "w2"); records the tensors it adds in ``t.expert_names`` and returns the canonical weight."""
        t.expert_names.append(f"{name}.weight")
        return self.linear(name, out, inp, dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_shards(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """Write ``tensors`` (in order) as ``shards`` files + index, or one ``model.safetensors`` if 1."""
    names = list(tensors)
    if shards <= 1:
        save_file({n: tensors[n] for n in names}, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    shards = min(shards, len(names))
    total = sum(_nbytes(t) for t in tensors.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc, g = 0, 0
    for i, n in enumerate(names):
        target = min(shards - 1, acc * shards // max(total, 1))  # balanced by bytes
        g = min(target, g + 1) if groups[g] else g  # never leave a shard empty ...
        g = max(g, shards - (len(names) - i))  # ... including the last ones
        groups[g].append(n)
        acc += _nbytes(tensors[n])
    groups = [grp for grp in groups if grp]
    k = len(groups)
    weight_map: dict[str, str] = {}
    for i, grp in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{k:05d}.safetensors"
        save_file({n: tensors[n] for n in grp}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in grp})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_side_files(path: Path, config: dict[str, Any]) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    vocab = {f"<t{i}>": i for i in range(8)}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<t0>"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2) + "\n")
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "bos_token": "<t0>", "eos_token": "<t1>"}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "transformers_version": "4.55.0"}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

