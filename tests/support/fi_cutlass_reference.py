"""An independent re-enactment of vLLM 0.33's load path for ``FLASHINFER_CUTLASS_MXFP4_*``, for the
flashinfer-cutlass layout tests (CPU and GPU).

* :func:`vllm_params`: the zero-initialised padded parameters the quant method allocates (bf16
  biases) with the checkpoint copied in by the weight loader (halves: each half at its own offset);
* :func:`vllm_convert`: the ``FLASHINFER_CUTLASS_MXFP4_*`` branch of
  ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format`` (interleaved rows) or
  ``convert_weight_to_mxfp4_moe_kernel_format`` (halves), step by step as vLLM writes it, with
  FlashInfer's helpers passed in (its real functions on a GPU, pure-torch stand-ins on CPU);
* :func:`fp4_interleave_scalar`: the SM90 FP4 weight interleave kernel's loop, one thread at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mxconv.experts.stack import CanonicalExperts

Helper = Callable[[torch.Tensor], torch.Tensor]


def make_stack(E: int, H: int, I: int, row_order: str, bias: bool = True, seed: int = 0) -> CanonicalExperts:
    """Random canonical MXFP4 bytes (every byte value, scales included) and bf16 biases."""
    g = torch.Generator().manual_seed(seed)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    return CanonicalExperts(
        w13=u8(E, 2 * I, H // 2), w13_scale=u8(E, 2 * I, H // 32), w2=u8(E, H, I // 2), w2_scale=u8(E, H, I // 32),
        w13_bias=bf16(E, 2 * I) if bias else None, w2_bias=bf16(E, H) if bias else None, row_order=row_order,
    )


def vllm_params(c: CanonicalExperts, Hp: int, Ip: int) -> dict[str, torch.Tensor]:
    """The layer's parameters after weight loading (padded with zeros, biases bfloat16)."""
    E, H, I = c.num_experts, c.hidden_size, c.intermediate_size
    p = {
        "w13": torch.zeros(E, 2 * Ip, Hp // 2, dtype=torch.uint8),
        "w13_scale": torch.zeros(E, 2 * Ip, Hp // 32, dtype=torch.uint8),
        "w2": torch.zeros(E, Hp, Ip // 2, dtype=torch.uint8),
        "w2_scale": torch.zeros(E, Hp, Ip // 32, dtype=torch.uint8),
        "w13_bias": torch.zeros(E, 2 * Ip, dtype=torch.bfloat16),
        "w2_bias": torch.zeros(E, Hp, dtype=torch.bfloat16),
    }
    for name, src, cols in (("w13", c.w13, H // 2), ("w13_scale", c.w13_scale, H // 32), ("w13_bias", c.w13_bias, None)):
        if src is None:
            continue
        dst = p[name] if cols is None else p[name][..., :cols]
        if c.row_order == "halves":
            dst[:, :I] = src[:, :I]
            dst[:, Ip : Ip + I] = src[:, I:]
        else:
            dst[:, : 2 * I] = src
    p["w2"][:, :H, : I // 2] = c.w2
    p["w2_scale"][:, :H, : I // 32] = c.w2_scale
    if c.w2_bias is not None:
        p["w2_bias"][:, :H] = c.w2_bias
    return p


def _w31(t: torch.Tensor, row_order: str) -> torch.Tensor:
    if row_order == "interleaved":  # gpt-oss: de-interleave, then chunk and swap
        deint = torch.cat([t[:, ::2], t[:, 1::2]], dim=1)
    else:
        deint = t
    w1, w3 = torch.chunk(deint, 2, dim=1)
    return torch.cat([w3, w1], dim=1)


def vllm_convert(p: dict[str, torch.Tensor], row_order: str, activation: str, *, weight_interleave: Helper,
                 scale_fold: Helper, block_scale_interleave: Helper) -> dict[str, torch.Tensor]:  # fmt: skip
    """The tensors vLLM holds after its FLASHINFER_CUTLASS_MXFP4_{BF16,MXFP8} conversion."""
    w13, s13 = _w31(p["w13"], row_order), _w31(p["w13_scale"], row_order)
    out = {"w13_bias": _w31(p["w13_bias"].float(), row_order).to(torch.bfloat16), "w2_bias": p["w2_bias"]}
    if activation == "mxfp8":
        out["w13_weight"], out["w2_weight"] = w13, p["w2"]
        out["w13_weight_scale"] = block_scale_interleave(s13.view(torch.uint8)).reshape(s13.shape)
        out["w2_weight_scale"] = block_scale_interleave(p["w2_scale"].view(torch.uint8)).reshape(p["w2_scale"].shape)
    else:
        out["w13_weight"] = weight_interleave(w13.contiguous())
        out["w2_weight"] = weight_interleave(p["w2"].contiguous())
        out["w13_weight_scale"] = scale_fold(s13.to(torch.uint8))
        out["w2_weight_scale"] = scale_fold(p["w2_scale"].to(torch.uint8))
    return out


# interleave_fp4_weights_for_sm90_mixed_gemm_kernel's bit moves: (mask, shift), shift > 0 = left
_FP4_BIT_MOVES = (
    (0x00000080, 24), (0x00000070, 18), (0x00000008, 12), (0x00000007, 6),
    (0x00008000, 13), (0x00007000, 7), (0x00000800, 1), (0x00000700, -5),
    (0x00800000, 2), (0x00700000, -4), (0x00080000, -10), (0x00070000, -16),
    (0x80000000, -1), (0x10000000, 1), (0x60000000, -3), (0x08000000, -13), (0x01000000, -11), (0x06000000, -15),
)


def fp4_interleave_scalar(w: torch.Tensor) -> torch.Tensor:
    """One expert [n, k/2] through the kernel's (block, partition, lane) loop in plain Python."""
    rows, half = w.shape
    cols = 2 * half
    src = w.flatten().tolist()
    dst: list[int | None] = [None] * len(src)
    for block in range(rows // 2):
        for part in range(cols // 64):
            for lane in range(16):
                row, mma = block // 8 * 16 + block % 8, lane // 4
                col = part * 32 + mma * 8 + lane % 4
                a, b = row * half + col, (row + 8) * half + col
                raw = src[a] | src[b] << 8 | src[a + 4] << 16 | src[b + 4] << 24
                word = 0
                for mask, shift in _FP4_BIT_MOVES:
                    word |= (raw & mask) << shift if shift > 0 else (raw & mask) >> -shift
                at = (row + (mma % 2) * 8) * half + part * 32 + lane // 8 * 16 + (lane % 4) * 4
                for j in range(4):
                    dst[at + j] = (word >> (8 * j)) & 0xFF
    assert None not in dst, "the loop left bytes unwritten"
    return torch.tensor(dst, dtype=torch.uint8).reshape(rows, half)


def fp4_interleave_scalar_stack(w: torch.Tensor) -> torch.Tensor:
    """:func:`fp4_interleave_scalar` over every expert of [E, n, k/2]."""
    return torch.stack([fp4_interleave_scalar(e) for e in w])
