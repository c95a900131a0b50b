"""Routed experts stored as compressed-tensors INT4 ``pack-quantized`` (Kimi-K2-Thinking style;
docs/checkpoint-formats.md section 5), read into mxconv's canonical int4 form (:mod:`mxconv.mx.int4`).

Per routed expert projection ``P`` (N = out, K = in):

| tensor                | shape    | dtype | meaning |
|-----------------------|----------|-------|---------|
| ``P.weight_packed``   | [N, K/8] | I32   | 8 offset-binary int4 values a word, value j in bits 4*(j%8) of word j//8 |
| ``P.weight_scale``    | [N, K/32]| BF16  | w = q * scale, one scale per 32 along K |
| ``P.weight_shape``    | [2]      | I64   | [N, K] |

Headers are checked with the family's other formats (:meth:`PerExpertReader._check_layer`, from
:func:`int4_proj_specs`); :func:`read_int4_stack` checks what only the data can show: every
``weight_shape`` equals the [N, K] the header shapes and config.json give, and every scale is finite.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from mxconv.errors import BadInput
from mxconv.families.base import Int4Stack
from mxconv.mx.int4 import GROUP_SIZE, VALUES_PER_WORD, words_as_bytes

if TYPE_CHECKING:

    from mxconv.source.checkpoint import Checkpoint

# (expert, projection index, parameter e.g. "weight_packed") -> the tensor's name in the checkpoint
ExpertTensorName = Callable[[int, int, str], str]

ProjSpec = tuple[str, tuple[str, ...], tuple[int, ...], str]


def int4_proj_specs(n: int, k: int, why: str) -> list[ProjSpec]:
    """(param, allowed safetensors dtypes, shape, why) of one INT4 projection with ``n`` outputs and
    ``k`` inputs; ``why`` says where [n, k] comes from."""
    return [
        ("weight_packed", ("I32",), (n, k // VALUES_PER_WORD), why + ", eight int4 values per int32 word"),
        ("weight_scale", ("BF16",), (n, k // GROUP_SIZE), f"one bf16 scale per {GROUP_SIZE} inputs of [{n}, {k}]"),
        ("weight_shape", ("I64",), (2,), "[rows, columns] of the unpacked weight"),
    ]


def _fail(ckpt: Checkpoint, name: str, problem: str) -> BadInput:
    info = ckpt.tensors.get(name)
    where = info.file if info is not None else ckpt.root
    return BadInput(f"{where}: tensor {name!r} {problem}")


def read_int4_stack(
    ckpt: Checkpoint, tensor_name: ExpertTensorName, num_experts: int, projs: tuple[int, ...], n: int, k: int,
    experts: tuple[int, int] | None = None,
) -> Int4Stack:
    """Read projections ``projs`` (stacked along the rows, gate then up for w13) of every one of the
    layer's ``num_experts`` experts (or of experts [e0, e1)), named by ``tensor_name``, into one canonical :class:`Int4Stack`: data uint8
    [E, n, k/2] (the words' bytes, offset-binary), scales bf16 [E, n, k/32].

    BadInput naming the shard file, the tensor and the rule when a ``weight_shape`` disagrees with
    [rows, k] or a scale is NaN/Inf.
    """
    import torch

    e0, e1 = experts or (0, num_experts)
    rows = n // len(projs)
    data = torch.empty((e1 - e0, n, k // 2), dtype=torch.uint8)
    scales = torch.empty((e1 - e0, n, k // GROUP_SIZE), dtype=torch.bfloat16)
    for e in range(e0, e1):
        for j, proj in enumerate(projs):
            part = slice(j * rows, (j + 1) * rows)
            shape_name = tensor_name(e, proj, "weight_shape")
            stated = [int(v) for v in ckpt.read(shape_name).tolist()]
            if stated != [rows, k]:
                raise _fail(
                    ckpt, shape_name,
                    f"says the weight is {stated}, but its weight_packed/weight_scale headers and config.json give "
                    f"[{rows}, {k}] (weight_shape must equal [rows, columns] of the unpacked weight)",
                )
            data[e - e0, part] = words_as_bytes(ckpt.read(tensor_name(e, proj, "weight_packed")))
            scale_name = tensor_name(e, proj, "weight_scale")
            s = ckpt.read(scale_name)
            bad = ~torch.isfinite(s)
            if bool(bad.any()):
                r, c = (int(i) for i in bad.nonzero()[0])
                raise _fail(
                    ckpt, scale_name,
                    f"holds {s[r, c].item()} at [{r}, {c}] (INT4 group scales must be finite; w = q * scale)",
                )
            scales[e - e0, part] = s
    return Int4Stack(data, scales)
