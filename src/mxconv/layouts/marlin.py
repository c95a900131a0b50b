"""vLLM Marlin MXFP4 MoE layout (spec: docs/layout-marlin.md).

Per expert, a weight matrix with N output rows and K inputs goes

    uint8 [N, K/2] (E2M1 pairs, low nibble = even k)  ->  int32 [K/16, 2N]   (tile stream, §4)
    uint8 [N, K/32] (E8M0 scales)                      ->  e8m0  [K/32, N]    (chunk permutation, §5)
    bias  [N]                                          ->  bf16  [N]          (32-chunk permutation, §6)

with w13: N = 2*Ip, K = Hp and w2: N = Hp, K = Ip, after zero padding to Hp = round_up(H, 256),
Ip = round_up(I, 128) (§3). Everything works on the whole [E, ...] stack at once with views,
permutes and index_select, so CPU and CUDA give the same bytes. ``to_kernel`` fuses the padding
into one row gather per tensor and builds the weight stream from 32-bit words
(:func:`marlin_weight_repack_words`); on CUDA the Triton kernels of ``mxconv.kernels.layout_triton``
do each tensor in one pass (the legacy scale weave stays in torch).

Activations: "bf16" (16-bit activations, 16x64 weight tiles, the default) and "fp8" (W4A8-FP8,
32x32 weight tiles, scales +6).

Options read (a plain dict, other keys ignored):
    marlin_scale_layout: "current" (vLLM >= 0.12, default) | "legacy" (vLLM 0.10.2 - 0.11.2,
                         bf16 activation only; extra row-pair weave of the scales, §5.3).
"""

from __future__ import annotations

from typing import Any

import torch

from mxconv.errors import LayoutError
from mxconv.numerics import pack_fp4, unpack_fp4
from mxconv.layouts.base import (
    KERNEL_TENSOR_NAMES,
    ROW_ORDERS,
    CanonicalExperts,
    KernelTensors,
    LayoutBase,
    LayoutOption,
    LayoutSizes,
    TensorSpec,
    cached_index,
    gather_padded_rows,
    layout_kernels,
    pad_row_source,
    round_up,
    unpad_canonical,
)

HIDDEN_MULTIPLE = 256  # Hp = round_up(H, 256)
INTERMEDIATE_MULTIPLE = 128  # Ip = round_up(I, 128)
FP8_SCALE_OFFSET = 6  # E4M3 bias (7) - E2M1 bias (1), added to every scale byte for fp8 activations
FP8_SCALE_MAX_INPUT = 255 - FP8_SCALE_OFFSET  # 249: larger bytes are rejected by vLLM
SCALE_LAYOUTS = ("current", "legacy")
ACTIVATIONS = ("bf16", "fp8")

# Weight tile digit orders (§4.2 / §4.3). The codes Q[N, K] of one expert are viewed with these
# digit sizes (most significant first) and permuted to the stream order
# (kt, nt, thc, thr, w, j2, j1, j0): stream position -> word 4*(4*thc+thr)+w of tile (kt, nt),
# nibble 4*j2 + 2*j1 + j0.
_STREAM_ORDER = ("kt", "nt", "thc", "thr", "w", "j2", "j1", "j0")


def _weight_digits(activation: str, N: int, K: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Digit names and sizes of Q[N, K] (n digits then k digits, most significant first)."""
    if activation == "bf16":
        return ("nt", "w", "j1", "thc", "kt", "j0", "thr", "j2"), (N // 64, 4, 2, 8, K // 16, 2, 4, 2)
    if activation == "fp8":
        return ("nt", "w", "thc", "kt", "j0", "thr", "j2", "j1"), (N // 32, 4, 8, K // 32, 2, 4, 2, 2)
    raise LayoutError(f"unknown Marlin activation {activation!r} (expected one of {ACTIVATIONS})")


def _check_weight_dims(activation: str, N: int, K: int, name: str) -> None:
    k_mult = 16 if activation == "bf16" else 32
    if N % 64 or K % k_mult:
        raise LayoutError(
            f"{name}: Marlin repack ({activation} activations) needs N % 64 == 0 and K % {k_mult} == 0, "
            f"got N = {N}, K = {K}"
        )


def _stream_permutation(activation: str, N: int, K: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(digit sizes of Q, permutation of those digits giving the stream order)."""
    names, sizes = _weight_digits(activation, N, K)
    return sizes, tuple(names.index(d) for d in _STREAM_ORDER)


# ---------------------------------------------------------------------------------------------
# Nibbles
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Weights (§4)
# ---------------------------------------------------------------------------------------------


def marlin_weight_repack(w: torch.Tensor, activation: str = "bf16", name: str = "weight") -> torch.Tensor:
    """Canonical uint8 [E, N, K/2] -> Marlin int32 [E, K/16, 2N] (tensor recipe of §4.2 / §4.3).

    ``activation`` is "bf16" (16x64 tiles) or "fp8" (32x32 tiles). Needs N % 64 == 0 and
    K % 16 == 0 (K % 32 == 0 for fp8); ``name`` is used in the error message.
    """
    E, N, half_k = (int(d) for d in w.shape)
    K = 2 * half_k
    _check_weight_dims(activation, N, K, name)
    sizes, perm = _stream_permutation(activation, N, K)
    codes = unpack_fp4(w).reshape(E, *sizes)
    stream = codes.permute(0, *(p + 1 for p in perm)).reshape(E, K // 16, 16 * N)
    return pack_fp4(stream).contiguous().view(torch.int32)


def marlin_weight_unrepack(q: torch.Tensor, activation: str = "bf16", name: str = "weight") -> torch.Tensor:
    """Inverse of :func:`marlin_weight_repack`: int32 [E, K/16, 2N] -> uint8 [E, N, K/2]."""
    E, k16, two_n = (int(d) for d in q.shape)
    N, K = two_n // 2, 16 * k16
    _check_weight_dims(activation, N, K, name)
    sizes, perm = _stream_permutation(activation, N, K)
    stream_sizes = tuple(sizes[p] for p in perm)
    codes = unpack_fp4(q.contiguous().view(torch.uint8)).reshape(E, *stream_sizes)
    inverse = [0] * len(perm)
    for out_dim, src_dim in enumerate(perm):
        inverse[src_dim] = out_dim
    q_nk = codes.permute(0, *(p + 1 for p in inverse)).reshape(E, N, K)
    return pack_fp4(q_nk).contiguous()


# 32-bit masks as signed int32 values (0xF0F0F0F0, 0xFF00FF00, 0xFFFF0000 wrap to negatives).
_LO_NIBBLES, _HI_NIBBLES = 0x0F0F0F0F, -0x0F0F0F10
_EVEN_BYTES, _ODD_BYTES = 0x00FF00FF, -0x00FF0100
_LOW_HALF, _HIGH_HALF = 0x0000FFFF, -0x00010000


def _nibble_merge(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per byte of int32 words: (x.lo | y.lo << 4, x.hi | y.hi << 4)."""
    lo = (x & _LO_NIBBLES) | ((y << 4) & _HI_NIBBLES)
    hi = ((x >> 4) & _LO_NIBBLES) | (y & _HI_NIBBLES)
    return lo, hi


def _byte_interleave(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of int32 words (x0 x1 x2 x3), (y0 y1 y2 y3) -> (x0 y0 x2 y2), (x1 y1 x3 y3)."""
    return (x & _EVEN_BYTES) | ((y << 8) & _ODD_BYTES), ((x >> 8) & _EVEN_BYTES) | (y & _ODD_BYTES)


def _half_interleave(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """16-bit halves of int32 words (x0 x1), (y0 y1) -> (x0 y0), (x1 y1)."""
    return (x & _LOW_HALF) | (y << 16), ((x >> 16) & _LOW_HALF) | (y & _HIGH_HALF)


def marlin_weight_repack_words(w: torch.Tensor, activation: str = "bf16", name: str = "weight") -> torch.Tensor:
    """Same result as :func:`marlin_weight_repack`, computed on 32-bit words of the packed bytes
    (nibble masks and byte shuffles, no unpacking to one code per byte): the CPU path of
    ``to_kernel`` and the algorithm of the Triton kernel.

    bf16 word (kt, nt, thc, thr, w) has bytes (A.lo|B.lo<<4, C.lo|D.lo<<4, A.hi|B.hi<<4, C.hi|D.hi<<4)
    where A, B are bytes 8kt+thr and 8kt+4+thr of row n = 64nt+16w+thc and C, D the same bytes of
    row n+8. fp8 word has bytes (A.lo|B.lo<<4, A.hi|B.hi<<4, C.lo|D.lo<<4, C.hi|D.hi<<4) with A, C
    bytes 16kt+2thr, +1 and B, D bytes 16kt+8+2thr, +1 of row 32nt+8w+thc.
    """
    E, N, half_k = (int(d) for d in w.shape)
    K = 2 * half_k
    _check_weight_dims(activation, N, K, name)
    x = w.contiguous().view(torch.int32)  # [E, N, K/8]
    if activation == "bf16":
        x = x.reshape(E, N // 64, 4, 2, 8, K // 16, 2)  # [E, nt, w, j1, thc, kt, j0]
        p, r = _nibble_merge(x[:, :, :, 0, :, :, 0], x[:, :, :, 0, :, :, 1])
        q, s = _nibble_merge(x[:, :, :, 1, :, :, 0], x[:, :, :, 1, :, :, 1])
        t0, t1 = _byte_interleave(p, q)  # p0 q0 p2 q2 / p1 q1 p3 q3
        t2, t3 = _byte_interleave(r, s)
        o0, o2 = _half_interleave(t0, t2)
        o1, o3 = _half_interleave(t1, t3)
    else:
        x = x.reshape(E, N // 32, 4, 8, K // 32, 4)  # [E, nt, w, thc, kt, word of the 16-byte chunk]
        l01, h01 = _nibble_merge(x[..., 0], x[..., 2])
        l23, h23 = _nibble_merge(x[..., 1], x[..., 3])
        e0, f0 = _byte_interleave(l01, h01)
        e1, f1 = _byte_interleave(l23, h23)
        o0, o1 = _half_interleave(e0, f0)
        o2, o3 = _half_interleave(e1, f1)
    words = torch.stack((o0, o1, o2, o3), dim=-1)  # [E, nt, w, thc, kt, thr]
    return words.permute(0, 4, 1, 3, 5, 2).reshape(E, K // 16, 2 * N)


def weight_source_index(
    K: int, N: int, activation: str = "bf16", device: torch.device | str | None = None
) -> torch.Tensor:
    """LongTensor [K/16, 16N]: for each code of one expert's output stream (row, 8*word + nibble),
    the flat index ``n*K + k`` of the element of Q[N, K] it holds."""
    _check_weight_dims(activation, N, K, "weight")
    sizes, perm = _stream_permutation(activation, N, K)
    flat = torch.arange(N * K, dtype=torch.long, device=device).reshape(sizes)
    return flat.permute(*perm).reshape(K // 16, 16 * N).contiguous()


# ---------------------------------------------------------------------------------------------
# Chunk permutations (scales §5, bias §6). A perm is a LongTensor: output column p of a chunk
# takes source column perm[p].
# ---------------------------------------------------------------------------------------------


def inverse_perm(perm: torch.Tensor) -> torch.Tensor:
    """LongTensor inv with inv[perm[p]] = p (same device)."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=perm.dtype, device=perm.device)
    return inv


def scale_transpose_perm(device: torch.device | str | None = None) -> torch.Tensor:
    """[64] step (a) of §5.1: 8x8 transpose of a 64-chunk, out[8i + j] = in[i + 8j]."""
    p = torch.arange(64, dtype=torch.long, device=device)
    return (p >> 3) + 8 * (p & 7)


def scale_regroup_perm(device: torch.device | str | None = None) -> torch.Tensor:
    """[64] step (b) of §5.1: in every run of 4 swap the middle two (a b c d -> a c b d)."""
    p = torch.arange(64, dtype=torch.long, device=device)
    low2 = p & 3
    swapped = torch.where((low2 == 1) | (low2 == 2), 3 - low2, low2)
    return (p & ~3) + swapped


def scale_perm_bf16(device: torch.device | str | None = None) -> torch.Tensor:
    """[64] current 16-bit scale chunk map (§5.1): c = 32*p2 + 16*p0 + 8*p1 + (p >> 3)."""
    p = torch.arange(64, dtype=torch.long, device=device)
    return 32 * ((p >> 2) & 1) + 16 * (p & 1) + 8 * ((p >> 1) & 1) + (p >> 3)


def chunk32_perm(device: torch.device | str | None = None) -> torch.Tensor:
    """[32] FP8 scale map (§5.2) and bias map (§6): c = 8*((p & 7) >> 1) + 2*(p >> 3) + (p & 1).
    An involution."""
    p = torch.arange(32, dtype=torch.long, device=device)
    return 8 * ((p & 7) >> 1) + 2 * (p >> 3) + (p & 1)


def permute_chunks(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Apply ``perm`` (length C) to every C-chunk of the last dim of ``x`` [..., M], M % C == 0."""
    C, M = perm.numel(), x.shape[-1]
    if M % C:
        raise LayoutError(f"last dimension {M} is not a multiple of the permutation chunk {C}")
    chunks = x.reshape(*x.shape[:-1], M // C, C)
    return chunks.index_select(-1, perm.to(x.device)).reshape(x.shape)


def legacy_weave(a: torch.Tensor, name: str = "scales") -> torch.Tensor:
    """§5.3 row-pair weave on [..., G, N] (G even, N % 8 == 0): the pair (2r, 2r+1) read as one
    stream A[2r][0:8], A[2r+1][0:8], A[2r][8:16], ... whose first N bytes become row 2r."""
    G, N = a.shape[-2], a.shape[-1]
    if G % 2:
        raise LayoutError(
            f"{name}: the legacy Marlin scale layout needs an even number of scale groups (K % 64 == 0), got {G}"
        )
    lead = a.shape[:-2]
    pairs = a.reshape(*lead, G // 2, 2, N // 8, 8)
    nd = pairs.dim()
    woven = pairs.permute(*range(nd - 4), nd - 4, nd - 2, nd - 3, nd - 1)
    return woven.reshape(a.shape)


def legacy_unweave(a: torch.Tensor, name: str = "scales") -> torch.Tensor:
    """Inverse of :func:`legacy_weave` on [..., G, N]."""
    G, N = a.shape[-2], a.shape[-1]
    if G % 2:
        raise LayoutError(
            f"{name}: the legacy Marlin scale layout needs an even number of scale groups (K % 64 == 0), got {G}"
        )
    lead = a.shape[:-2]
    woven = a.reshape(*lead, G // 2, N // 8, 2, 8)
    nd = woven.dim()
    pairs = woven.permute(*range(nd - 4), nd - 4, nd - 2, nd - 3, nd - 1)
    return pairs.reshape(a.shape)


# ---------------------------------------------------------------------------------------------
# Scales (§5) and bias (§6)
# ---------------------------------------------------------------------------------------------


def marlin_scales(
    s: torch.Tensor, activation: str = "bf16", scale_layout: str = "current", name: str = "weight_scale"
) -> torch.Tensor:
    """Canonical uint8 [E, N, G] E8M0 bytes -> Marlin byte layout uint8 [E, G, N] (view it as
    float8_e8m0fnu for the kernel tensor). N % 64 == 0 (bf16) or N % 32 == 0 (fp8).

    fp8: bytes above 249 raise LayoutError naming ``name``; every byte gets +6.
    """
    _check_scale_mode(activation, scale_layout)
    g_n = s.transpose(-1, -2)
    if activation == "fp8":
        too_big = s > FP8_SCALE_MAX_INPUT
        if bool(too_big.any()):
            idx = [int(i) for i in too_big.nonzero()[0].tolist()]
            raise LayoutError(
                f"{name} at index {idx} holds E8M0 byte {int(s[tuple(idx)])}: FP8-activation Marlin adds "
                f"{FP8_SCALE_OFFSET} to every scale byte and needs bytes <= {FP8_SCALE_MAX_INPUT}"
            )
        return (permute_chunks(g_n, chunk32_perm(s.device)) + FP8_SCALE_OFFSET).contiguous()
    if scale_layout == "current":
        return permute_chunks(g_n, scale_perm_bf16(s.device)).contiguous()
    stepped = permute_chunks(g_n, scale_transpose_perm(s.device))
    woven = legacy_weave(stepped, name)
    return permute_chunks(woven, scale_regroup_perm(s.device)).contiguous()


def marlin_unscales(
    m: torch.Tensor, activation: str = "bf16", scale_layout: str = "current", name: str = "weight_scale"
) -> torch.Tensor:
    """Inverse of :func:`marlin_scales`: uint8 [E, G, N] -> canonical uint8 [E, N, G].

    fp8: bytes below 6 cannot come out of the forward map and raise LayoutError naming ``name``.
    """
    _check_scale_mode(activation, scale_layout)
    if activation == "fp8":
        too_small = m < FP8_SCALE_OFFSET
        if bool(too_small.any()):
            idx = [int(i) for i in too_small.nonzero()[0].tolist()]
            raise LayoutError(
                f"{name} at index {idx} holds byte {int(m[tuple(idx)])}: FP8-activation Marlin scales are "
                f"stored +{FP8_SCALE_OFFSET}, so every byte must be >= {FP8_SCALE_OFFSET}"
            )
        g_n = permute_chunks(m - FP8_SCALE_OFFSET, chunk32_perm(m.device))
    elif scale_layout == "current":
        g_n = permute_chunks(m, inverse_perm(scale_perm_bf16(m.device)))
    else:
        regrouped = permute_chunks(m, scale_regroup_perm(m.device))
        g_n = permute_chunks(legacy_unweave(regrouped, name), scale_transpose_perm(m.device))
    return g_n.transpose(-1, -2).contiguous()


def marlin_bias(b: torch.Tensor) -> torch.Tensor:
    """Bias [E, N] (any float) -> bf16 [E, N] permuted in chunks of 32 (§6). N % 32 == 0."""
    return permute_chunks(b.to(torch.bfloat16), chunk32_perm(b.device)).contiguous()


def marlin_unbias(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`marlin_bias` (the map is an involution): [E, N] -> float32 [E, N]."""
    return permute_chunks(b, chunk32_perm(b.device)).to(torch.float32).contiguous()


def _check_scale_mode(activation: str, scale_layout: str) -> None:
    if activation not in ACTIVATIONS:
        raise LayoutError(f"unknown Marlin activation {activation!r} (expected one of {ACTIVATIONS})")
    if scale_layout not in SCALE_LAYOUTS:
        raise LayoutError(f"unknown marlin_scale_layout {scale_layout!r} (expected one of {SCALE_LAYOUTS})")
    if scale_layout == "legacy" and activation != "bf16":
        raise LayoutError(
            "the legacy Marlin scale layout (vLLM <= 0.11.2) exists only for 16-bit activations; "
            f"got activation {activation!r}"
        )


# ---------------------------------------------------------------------------------------------
# The Layout
# ---------------------------------------------------------------------------------------------


class MarlinLayout(LayoutBase):
    """vLLM Marlin MXFP4 MoE backend (see module docstring for options)."""

    name = "marlin"
    version = 1
    activations: tuple[str, ...] = ACTIVATIONS
    # fp8 is the same backends with VLLM_MARLIN_INPUT_DTYPE=fp8 (W4A8-FP8)
    vllm_backends = {"bf16": ("MARLIN", "BATCHED_MARLIN"), "fp8": ("MARLIN", "BATCHED_MARLIN")}
    kernel_runner = "mxconv.engines"  # vLLM's own kernel runs on these bytes (verify --kernel)
    options = (
        LayoutOption(
            "marlin_scale_layout", str, "current",
            "current (vLLM >= 0.12) or legacy (vLLM 0.10.2 - 0.11.2, bf16 activations only)",
            choices=SCALE_LAYOUTS,
        ),
    )

    # -- sizes ---------------------------------------------------------------------------------

    def padded_sizes(
        self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
        options: dict[str, Any] | None = None,
    ) -> tuple[int, int]:
        """(Hp, Ip) = (round_up(H, 256), round_up(I, 128)); H and I must be positive multiples of 32."""
        self._check_activation(activation)
        if row_order not in ROW_ORDERS:
            raise LayoutError(f"unknown w13 row order {row_order!r} (expected one of {ROW_ORDERS})")
        for label, size in (("hidden size", hidden_size), ("intermediate size", intermediate_size)):
            if size <= 0 or size % 32:
                raise LayoutError(
                    f"{label} {size} cannot be laid out for Marlin: MXFP4 needs a positive multiple of 32 "
                    "(one E8M0 scale per 32 elements)"
                )
        return round_up(hidden_size, HIDDEN_MULTIPLE), round_up(intermediate_size, INTERMEDIATE_MULTIPLE)

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: dict[str, Any]) -> dict[str, TensorSpec]:
        """w13_weight int32 [E, Hp/16, 4Ip], w13_weight_scale e8m0 [E, Hp/32, 2Ip], w13_bias bf16 [E, 2Ip],
        w2_weight int32 [E, Ip/16, 2Hp], w2_weight_scale e8m0 [E, Ip/32, Hp], w2_bias bf16 [E, Hp]."""
        _check_scale_mode(activation, _scale_layout(options))
        E, Hp, Ip = sizes.num_experts, sizes.padded_hidden_size, sizes.padded_intermediate_size
        specs = {
            "w13_weight": TensorSpec((E, Hp // 16, 4 * Ip), torch.int32),
            "w13_weight_scale": TensorSpec((E, Hp // 32, 2 * Ip), torch.float8_e8m0fnu),
            "w2_weight": TensorSpec((E, Ip // 16, 2 * Hp), torch.int32),
            "w2_weight_scale": TensorSpec((E, Ip // 32, Hp), torch.float8_e8m0fnu),
        }
        if sizes.has_bias:
            specs["w13_bias"] = TensorSpec((E, 2 * Ip), torch.bfloat16)
            specs["w2_bias"] = TensorSpec((E, Hp), torch.bfloat16)
        return {name: specs[name] for name in KERNEL_TENSOR_NAMES if name in specs}

    # -- conversion ----------------------------------------------------------------------------

    def to_kernel(self, c: CanonicalExperts, activation: str, options: dict[str, Any]) -> KernelTensors:
        """Pad (zero weights, zero scale bytes, zero bias) and lay out the whole stack on c's device."""
        scale_layout = _scale_layout(options)
        _check_scale_mode(activation, scale_layout)
        c.validate()  # includes: both biases or neither
        Hp, Ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation)
        H, I = c.hidden_size, c.intermediate_size
        # Padding is a row map (padded row <- source row, -1 = zero row) plus zero K columns.
        tab13 = _row_table(2 * I, 2 * Ip, c.row_order, None, c.device)
        tab2 = _row_table(H, Hp, None, None, c.device)
        lt = layout_kernels(c.w13)
        out: KernelTensors = {}
        if lt is not None:
            out["w13_weight"] = lt.marlin_weights(c.w13, tab13, Hp, activation)
            out["w2_weight"] = lt.marlin_weights(c.w2, tab2, Ip, activation)
        else:
            out["w13_weight"] = marlin_weight_repack_words(gather_padded_rows(c.w13, tab13, Hp // 2), activation, "w13_weight")
            out["w2_weight"] = marlin_weight_repack_words(gather_padded_rows(c.w2, tab2, Ip // 2), activation, "w2_weight")
        scale_jobs = (
            ("w13_weight_scale", c.w13_scale, 2 * I, 2 * Ip, Hp // 32, c.row_order),
            ("w2_weight_scale", c.w2_scale, H, Hp, Ip // 32, None),
        )
        scale_kernels = lt if scale_layout == "current" else None  # the legacy weave stays in torch
        too_big = None
        if scale_kernels is not None and activation == "fp8":
            # fp8 range check as a device flag: one sync at the end instead of one per tensor
            too_big = (c.w13_scale > FP8_SCALE_MAX_INPUT).any() | (c.w2_scale > FP8_SCALE_MAX_INPUT).any()
        for name, s, rows, padded_rows, cols, order in scale_jobs:
            out[name] = _kernel_scales(scale_kernels, s, rows, padded_rows, cols, order, activation, scale_layout, name)
        if c.w13_bias is not None and c.w2_bias is not None:
            # bias: the 32-chunk permutation folded into the row map
            b13 = _row_table(2 * I, 2 * Ip, c.row_order, 32, c.device)
            b2 = _row_table(H, Hp, None, 32, c.device)
            out["w13_bias"] = gather_padded_rows(c.w13_bias.to(torch.bfloat16), b13)
            out["w2_bias"] = gather_padded_rows(c.w2_bias.to(torch.bfloat16), b2)
        if too_big is not None and bool(too_big):
            for name, s, rows, padded_rows, cols, order in scale_jobs:  # the torch path names the byte
                _kernel_scales(None, s, rows, padded_rows, cols, order, activation, scale_layout, name)
        return {name: out[name] for name in KERNEL_TENSOR_NAMES if name in out}

    def from_kernel(
        self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: dict[str, Any]
    ) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel`; LayoutError on wrong shapes/dtypes or non-zero padding.
        Biases come back as float32."""
        scale_layout = _scale_layout(options)
        specs = self.kernel_specs(sizes, activation, options)
        for name in KERNEL_TENSOR_NAMES:
            if name not in specs:
                if name in k:
                    raise LayoutError(f"{name} present but the layer is declared without biases")
                continue
            if name not in k:
                raise LayoutError(f"{name} is missing from the Marlin kernel tensors")
            t, want = k[name], specs[name]
            if tuple(t.shape) != want.shape or t.dtype != want.dtype:
                raise LayoutError(
                    f"{name} has shape {tuple(t.shape)} dtype {t.dtype}, expected shape {want.shape} dtype {want.dtype}"
                )
        padded = CanonicalExperts(
            w13=marlin_weight_unrepack(k["w13_weight"], activation, "w13_weight"),
            w13_scale=marlin_unscales(
                k["w13_weight_scale"].view(torch.uint8), activation, scale_layout, "w13_weight_scale"
            ),
            w2=marlin_weight_unrepack(k["w2_weight"], activation, "w2_weight"),
            w2_scale=marlin_unscales(
                k["w2_weight_scale"].view(torch.uint8), activation, scale_layout, "w2_weight_scale"
            ),
            w13_bias=marlin_unbias(k["w13_bias"]) if sizes.has_bias else None,
            w2_bias=marlin_unbias(k["w2_bias"]) if sizes.has_bias else None,
            row_order=sizes.row_order,
        )
        return unpad_canonical(padded, sizes.hidden_size, sizes.intermediate_size, scale_fill=0, check=True)

    # -- manifest ------------------------------------------------------------------------------

    def describe(self, sizes: LayoutSizes, activation: str, options: dict[str, Any]) -> dict[str, Any]:
        """Manifest `layout` fields: name, version, engine_compat, activation, tile and scale layout."""
        scale_layout = _scale_layout(options)
        _check_scale_mode(activation, scale_layout)
        compat = {"vllm": ">=0.12"} if scale_layout == "current" else {"vllm": ">=0.10.2,<=0.11.2"}
        info: dict[str, Any] = {
            "name": self.name,
            "version": self.version,
            "engine_compat": compat,
            "activation": activation,
            "weight_tile": {"k": 16, "n": 64} if activation == "bf16" else {"k": 32, "n": 32},
            "scale_layout": scale_layout,
            "scale_chunk": 64 if activation == "bf16" else 32,
            "scale_offset": FP8_SCALE_OFFSET if activation == "fp8" else 0,
            "bias_chunk": 32,
            "padding": {"hidden_multiple": HIDDEN_MULTIPLE, "intermediate_multiple": INTERMEDIATE_MULTIPLE},
        }
        if activation == "fp8":
            info["runtime_env"] = {"VLLM_MARLIN_INPUT_DTYPE": "fp8"}
        return info

    @staticmethod
    def _check_activation(activation: str) -> None:
        if activation not in ACTIVATIONS:
            raise LayoutError(f"unknown Marlin activation {activation!r} (expected one of {ACTIVATIONS})")


def _chunk_perm_cpu(chunk: int) -> torch.Tensor:
    return scale_perm_bf16() if chunk == 64 else chunk32_perm()


def _row_table(
    rows: int, padded_rows: int, row_order: str | None, chunk: int | None, device: torch.device
) -> torch.Tensor:
    """Source row (unpadded) behind each padded row, -1 = padding (cached, on ``device``). With
    ``chunk`` (64: bf16 scale map, 32: fp8 scale / bias map) the padded rows are first permuted in
    chunks: entry p holds the source of padded row ``chunk*(p//chunk) + perm[p % chunk]``."""

    def build() -> torch.Tensor:
        pad = pad_row_source(rows, padded_rows, row_order)
        if chunk is None:
            return pad
        return permute_chunks(pad[None], _chunk_perm_cpu(chunk))[0]

    return cached_index(("marlin", rows, padded_rows, row_order, chunk), device, build)


def _kernel_scales(
    lt: Any,
    s: torch.Tensor,
    rows: int,
    padded_rows: int,
    cols: int,
    row_order: str | None,
    activation: str,
    scale_layout: str,
    name: str,
) -> torch.Tensor:
    """Unpadded canonical scales [E, rows, G] -> kernel tensor float8_e8m0fnu [E, cols, padded_rows].

    ``lt`` (the Triton kernel module, current/fp8 maps only; it does not range-check fp8 bytes) or
    None: the torch path, which raises LayoutError for fp8 bytes above 249."""
    fp8 = activation == "fp8"
    if lt is not None:
        tab = _row_table(rows, padded_rows, row_order, 32 if fp8 else 64, s.device)
        out = lt.transpose_rows(s, tab, cols, FP8_SCALE_OFFSET if fp8 else 0)
    else:
        tab = _row_table(rows, padded_rows, row_order, None, s.device)
        out = marlin_scales(gather_padded_rows(s, tab, cols, 0), activation, scale_layout, name)
    return out.view(torch.float8_e8m0fnu)


def _scale_layout(options: dict[str, Any] | None) -> str:
    """The `marlin_scale_layout` option ("current" when absent or None)."""
    value = (options or {}).get("marlin_scale_layout") or "current"
    if value not in SCALE_LAYOUTS:
        raise LayoutError(f"unknown marlin_scale_layout {value!r} (expected one of {SCALE_LAYOUTS})")
    return str(value)


LAYOUT = MarlinLayout()
