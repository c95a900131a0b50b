"""Marlin's byte maps as whole-stack tensor recipes (docs/layout-marlin.md): the weight tile stream
(§4), the scale chunk permutations and legacy weave (§5) and the bias permutation (§6), with their
inverses and index functions. :mod:`mxconv.layouts.marlin` fuses them with the padding.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxconv.errors import LayoutError
from mxconv.mx.formats import pack_fp4, unpack_fp4  # numerics imports torch, numerics_format does not

if TYPE_CHECKING:
    import torch

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
    import torch

    E, N, half_k = (int(d) for d in w.shape)
    K = 2 * half_k
    _check_weight_dims(activation, N, K, name)
    sizes, perm = _stream_permutation(activation, N, K)
    codes = unpack_fp4(w).reshape(E, *sizes)
    stream = codes.permute(0, *(p + 1 for p in perm)).reshape(E, K // 16, 16 * N)
    return pack_fp4(stream).contiguous().view(torch.int32)


def marlin_weight_unrepack(q: torch.Tensor, activation: str = "bf16", name: str = "weight") -> torch.Tensor:
    """Inverse of :func:`marlin_weight_repack`: int32 [E, K/16, 2N] -> uint8 [E, N, K/2]."""
    import torch

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
    import torch

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
    import torch

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
    import torch

    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=perm.dtype, device=perm.device)
    return inv


def scale_transpose_perm(device: torch.device | str | None = None) -> torch.Tensor:
    """[64] step (a) of §5.1: 8x8 transpose of a 64-chunk, out[8i + j] = in[i + 8j]."""
    import torch

    p = torch.arange(64, dtype=torch.long, device=device)
    return (p >> 3) + 8 * (p & 7)


def scale_regroup_perm(device: torch.device | str | None = None) -> torch.Tensor:
    """[64] step (b) of §5.1: in every run of 4 swap the middle two (a b c d -> a c b d)."""
    import torch

    p = torch.arange(64, dtype=torch.long, device=device)
    low2 = p & 3
    swapped = torch.where((low2 == 1) | (low2 == 2), 3 - low2, low2)
    return (p & ~3) + swapped


def scale_perm_bf16(device: torch.device | str | None = None) -> torch.Tensor:
    """[64] current 16-bit scale chunk map (§5.1): c = 32*p2 + 16*p0 + 8*p1 + (p >> 3)."""
    import torch

    p = torch.arange(64, dtype=torch.long, device=device)
    return 32 * ((p >> 2) & 1) + 16 * (p & 1) + 8 * ((p >> 1) & 1) + (p >> 3)


def chunk32_perm(device: torch.device | str | None = None) -> torch.Tensor:
    """[32] FP8 scale map (§5.2) and bias map (§6): c = 8*((p & 7) >> 1) + 2*(p >> 3) + (p & 1).
    An involution."""
    import torch

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
    check_scale_mode(activation, scale_layout)
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
    check_scale_mode(activation, scale_layout)
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
    import torch

    return permute_chunks(b.to(torch.bfloat16), chunk32_perm(b.device)).contiguous()


def marlin_unbias(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`marlin_bias` (the map is an involution): [E, N] -> float32 [E, N]."""
    import torch

    return permute_chunks(b, chunk32_perm(b.device)).to(torch.float32).contiguous()


def check_scale_mode(activation: str, scale_layout: str) -> None:
    """Raise ``LayoutError`` unless ``activation`` and ``scale_layout`` are known and go together."""
    if activation not in ACTIVATIONS:
        raise LayoutError(f"unknown Marlin activation {activation!r} (expected one of {ACTIVATIONS})")
    if scale_layout not in SCALE_LAYOUTS:
        raise LayoutError(f"unknown marlin_scale_layout {scale_layout!r} (expected one of {SCALE_LAYOUTS})")
    if scale_layout == "legacy" and activation != "bf16":
        raise LayoutError(
            "the legacy Marlin scale layout (vLLM <= 0.11.2) exists only for 16-bit activations; "
            f"got activation {activation!r}"
        )
