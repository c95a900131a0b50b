"""Triton kernels of ``quantize --format fp8-block``: MXFP4 -> block FP8 (power-of-two tile scales)
and floats -> block FP8 (amax/448), one program per 128x128 tile of one expert.

The bytes are those of :mod:`mxconv.mx.fp8_block` on the CPU (its module docstring has the rules).
MXFP4 takes two launches. The first reads each tile once as int32 words (8 codes each) with its scale
bytes, finds the tile's top exponent and, where every group with a non-zero code has
``k = s - 127 - t >= -5`` (then every element is an E4M3 normal, so the tile is exact), writes its
bytes with integer arithmetic on 4 codes per 32-bit word: the E4M3 magnitude of code ``c`` times
``2^k`` is ``0x30 + 4c + 8k`` (``0x30 + 8k`` for 0.5), the sign bit moves from bit 3 to bit 7. Tiles
with smaller ``k`` (E4M3 subnormals, lost bits) or a NaN scale are marked: the first launch appends
them to a list (an atomic count), and the second launch, a fixed grid looping over that list (no host
sync; nothing to do when it is empty), re-encodes them element by element in fp32 (the rules below).
Every output, the fp64 ``max_error`` included, is written by the kernels: no torch pass after them.
The first launch views a tile as [128 rows, 4 groups, 4 words], so each group's scale byte is loaded
once and the word keys reduce per group inside a thread (a sweep on an H200: 1.17 ms per gate_up stack
against 1.73 ms for [128, 16] words with a gathered scale byte per word).

Implementation notes:

* E4M3 bytes are formed by integer arithmetic on the fp32 bits (:func:`_e4m3_bits`), not by a cast:
  round to nearest even on mantissa bit 20 for normals, a magic add of 2^23 to ``|y| * 512`` for
  subnormals (|y| < 2^-6; the code of 2^-6 itself, 8, is its normal encoding too). The interpreter's
  fp32 -> fp8 cast is not exact and ``cvt.rn.satfinite`` would be the only other source of the
  rounding; with integers the same bytes come out of both, and the CPU test proves them.
* MXFP4 tiles: the E2M1 exponents come from the 3-bit magnitude code (``top = (c >> 1) - 1``, lowest
  set bit one lower for odd codes >= 3; code 1 = 0.5 has both at -1). An element is ``e2m1 * 2^k``
  with ``k = s - 127 - t``; like the torch path the factor is 0 below 2^-126 and a NaN scale (0xFF)
  makes every element of its group NaN (byte 0x7F: torch's CPU multiply keeps the factor's positive NaN).
  The sign bit is copied from the code, never made by negating a float: on an H200 the kernel's
  negated 0.0 came out +0.0, so code 8 (-0) gave byte 0x00 instead of 0x80 (the interpreter kept -0).
* Floats: ``scale_inv = amax / 448`` and ``x / scale_inv`` with ``div_rn`` (IEEE, as the CPU), then a
  clamp to +-448. On CUDA, fp32 subnormals flush to zero in float ops: a tile whose amax is below
  448 * 2^-126 (never in real weights) can differ from the CPU bytes.
"""

from __future__ import annotations

import torch

from mxconv.environment import triton_interpreter_on
from mxconv.errors import BadInput
from mxconv.kernels.triton_common import launch
from mxconv.kernels.triton_import import TRITON_IMPORT_ERROR, tl, triton
from mxconv.mx.formats import E4M3_MAX, E8M0_BIAS, E8M0_NAN
from mxconv.mx.fp8_block import E4M3_TOP_EXP, MAX_EXACT_SPREAD, TILE, BlockFP8, tiles

NUM_WARPS = 8  # MXFP4 tiles, integer path: 4 and 8 warps time alike on an H200, 16 is 9 % slower
FLOAT_WARPS = 16  # a 128x128 float tile per program: 16 warps 10 % faster than 8 on an H200, same bytes
SLOW_WARPS = 8  # MXFP4 tiles with E4M3 subnormals or NaN scales, element by element
SLOW_PROGRAMS = 1024  # programs of the slow launch (a grid-stride loop over the marked tiles)

if triton is not None:

    @triton.jit
    def _e4m3_bits(y):
        """E4M3 byte (int32) of fp32 ``y`` with |y| <= 448 (RNE), or 0x7F|sign for NaN."""
        b = y.to(tl.int32, bitcast=True)
        sign = (b >> 24) & 0x80
        a = b & 0x7FFFFFFF
        r = a + 0x7FFFF + ((a >> 20) & 1)  # RNE to 3 mantissa bits (a carry moves into the exponent)
        normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
        q = tl.abs(y) * 512.0 + 8388608.0  # 2^23: its ulp is 1, the FPU rounds |y| / 2^-9 to an integer
        sub = q.to(tl.int32, bitcast=True) - 0x4B000000
        code = tl.where(a < 0x3C800000, sub, normal)  # 0x3C800000: 2^-6, E4M3's smallest normal
        return tl.where(a > 0x7F800000, 0x7F, code) | sign

    @triton.jit
    def _e4m3_value(code):
        """fp32 value of an E4M3 magnitude code 0..126 (int32)."""
        e = code >> 3
        m = code & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)

    @triton.jit
    def _pow2_bits(t):
        """fp32 bits of 2^t (int32 t >= -149): normal from -126 up, a subnormal pattern below."""
        return tl.where(t >= -126, (t + 127) << 23, 1 << tl.maximum(t + 149, 0))

    @triton.jit
    def _mxfp4_tile_slow(
        d_ptr, s_ptr, q_ptr, N, KH, d_sn, s_sn, t,
        bi, bj, BIAS: tl.constexpr, NAN: tl.constexpr, T: tl.constexpr,
    ):  # fmt: skip
        """Any tile, element by element in fp32 (pointers already at the expert; bytes and int16 byte
        pairs): writes its E4M3 bytes and returns (largest |error| / 2^t, lowest set-bit exponent)."""
        rows = bi * T + tl.arange(0, T)
        cols = bj * (T // 2) + tl.arange(0, T // 2)  # byte columns: two elements each
        ok = (rows < N)[:, None] & (cols < KH)[None, :]
        byte = tl.load(d_ptr + rows[:, None] * d_sn + cols[None, :], mask=ok, other=0).to(tl.int32)
        sbyte = tl.load(s_ptr + rows[:, None] * s_sn + (cols // 16)[None, :], mask=ok, other=0).to(tl.int32)
        nan = sbyte == NAN
        ce, co = byte & 7, (byte >> 4) & 7
        big = 1 << 20
        low_e = tl.where((ce == 0) | nan | ~ok, big, tl.where(ce == 1, -1, (ce >> 1) - 1 - (ce & 1)) + sbyte - BIAS)
        low_o = tl.where((co == 0) | nan | ~ok, big, tl.where(co == 1, -1, (co >> 1) - 1 - (co & 1)) + sbyte - BIAS)
        low = tl.min(tl.min(tl.minimum(low_e, low_o), axis=1), axis=0)
        k = sbyte - BIAS - t
        factor = tl.where(k < -126, 0.0, (tl.minimum(tl.maximum(k, -126), 127) + 127 << 23).to(tl.float32, bitcast=True))
        ve = tl.where(ce < 2, ce.to(tl.float32) * 0.5, ((ce >> 1) + 126 << 23 | (ce & 1) << 22).to(tl.float32, bitcast=True))
        vo = tl.where(co < 2, co.to(tl.float32) * 0.5, ((co >> 1) + 126 << 23 | (co & 1) << 22).to(tl.float32, bitcast=True))
        xe, xo = ve * factor, vo * factor  # magnitudes: the sign bit comes from the code (CUDA's -x of 0.0 is +0.0)
        be = tl.where(nan, 0x7F, _e4m3_bits(xe) | ((byte & 8) << 4))
        bo = tl.where(nan, 0x7F, _e4m3_bits(xo) | (byte & 128))
        tl.store(q_ptr + rows[:, None] * KH + cols[None, :], (be | (bo << 8)).to(tl.int16), mask=ok)
        de = tl.where(nan, 0.0, tl.abs(xe - _e4m3_value(be & 0x7F)))
        do = tl.where(nan, 0.0, tl.abs(xo - _e4m3_value(bo & 0x7F)))
        return tl.max(tl.max(tl.maximum(de, do), axis=1), axis=0), low

    @triton.jit
    def _word_key(w):
        """Per uint32 word of 8 E2M1 codes: 0 if all are zero, else 2 + the leading-bit exponent of the
        largest (1 for 0.5, 2 for 1 and 1.5, 3 for 2 and 3, 4 for 4 and 6)."""
        m = w & 0x77777777
        key = (m != 0).to(tl.int32) + ((m & 0x66666666) != 0).to(tl.int32) + ((m & 0x44444444) != 0).to(tl.int32)
        return key + ((m & (m << 1) & 0x44444444) != 0).to(tl.int32)

    @triton.jit
    def _nibbles(h):
        """The 4 nibbles of the low 16 bits of uint32 ``h`` in the 4 byte lanes, in order."""
        x = (h | (h << 8)) & 0x00FF00FF
        return (x | (x << 4)) & 0x0F0F0F0F

    @triton.jit
    def _normal_bytes(x, base4):
        """E2M1 codes in the 4 byte lanes of ``x`` -> their E4M3 bytes when every non-zero one is an
        E4M3 normal: magnitude 0x30 + 4c + 8k (0x30 + 8k for c = 1, 0.5), ``base4`` = 0x30 + 8k per lane."""
        c = x & 0x07070707
        one = c & ~((c >> 1) | (c >> 2)) & 0x01010101
        nz = ((c + 0x07070707) >> 3) & 0x01010101
        return ((base4 + ((c - one) << 2)) & (nz * 0xFF)) | ((x & 0x08080808) << 4)

    @triton.jit
    def _pow2_f64(t):
        """2^t as fp64 (int32 t, |t| < 1000)."""
        return ((t + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)

    @triton.jit
    def _mxfp4_fast_kernel(
        d_ptr, s_ptr, q_ptr, sinv_ptr, exact_ptr, err_ptr, top_ptr, marked_ptr,
        N, KG, d_se, d_sn, s_se, s_sn, NB, KB,
        TOP_EXP: tl.constexpr, BIAS: tl.constexpr, NAN: tl.constexpr, T: tl.constexpr,
    ):  # fmt: skip
        """Tile (pid0 = column tile, pid1 = row tile, pid2 = expert) of MXFP4 words [E, N, K/8] (int32,
        8 codes each) + E8M0 [E, N, K/32 = KG]: its scale_inv bits and top exponent; where every non-zero
        element becomes an E4M3 normal (exact), its E4M3 bytes (int64 words [E, N, K/8]) with exact 1
        and error 0, else exact 2, its index appended to the list ``marked_ptr`` (count first) for
        :func:`_mxfp4_slow_kernel`. The tile is [T rows, T/32 groups,
        4 words]: one scale byte per group, the word keys reduced per group inside each thread."""
        bj, bi, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        rows = bi * T + tl.arange(0, T)
        g = bj * (T // 32) + tl.arange(0, T // 32)
        wcol = g[:, None] * 4 + tl.arange(0, 4)[None, :]
        okg = (rows < N)[:, None] & (g < KG)[None, :]
        woff = rows[:, None, None] * d_sn + wcol[None, :, :]
        w = tl.load(d_ptr + e * d_se + woff, mask=okg[:, :, None], other=0).to(tl.uint32, bitcast=True)
        sb = tl.load(s_ptr + e * s_se + rows[:, None] * s_sn + g[None, :], mask=okg, other=0).to(tl.int32)
        key = tl.max(_word_key(w), axis=2)
        big = 1 << 20
        top = tl.max(tl.max(tl.where((key > 0) & (sb != NAN), sb + key, -big), axis=1), axis=0)
        top = tl.where(top <= -big, -big, top - BIAS - 2)  # the exponent of the tile's leading bit
        t = tl.where(top <= -big, 0, top - TOP_EXP)
        # a NaN group (even of zeros) goes to the slow path: its bytes are all 0x7F
        smin = tl.min(tl.min(tl.where(okg & (sb == NAN), -big, tl.where(key > 0, sb, big)), axis=1), axis=0)
        tile = e * NB * KB + bi * KB + bj
        tl.store(sinv_ptr + tile, _pow2_bits(t))
        tl.store(top_ptr + tile, top)
        if smin - BIAS - t >= -5:  # k >= -5 in every group with a non-zero code: all E4M3 normals
            base4 = (0x30 + 8 * (sb - BIAS - t)).to(tl.uint32, bitcast=True) * 0x01010101
            lo = _normal_bytes(_nibbles(w & 0xFFFF), base4[:, :, None]).to(tl.uint64)
            hi = _normal_bytes(_nibbles(w >> 16), base4[:, :, None]).to(tl.uint64)
            out = (lo | (hi << 32)).to(tl.int64, bitcast=True)
            tl.store(q_ptr + e * N * KG * 4 + rows[:, None, None] * (KG * 4) + wcol[None, :, :], out, mask=okg[:, :, None])
            tl.store(exact_ptr + tile, 1)
            tl.store(err_ptr + tile, 0.0)
        else:
            tl.store(exact_ptr + tile, 2)
            tl.store(marked_ptr + 1 + tl.atomic_add(marked_ptr, 1), tile)

    @triton.jit
    def _mxfp4_slow_kernel(
        d_ptr, s_ptr, q_ptr, exact_ptr, err_ptr, top_ptr, marked_ptr,
        N, KH, d_se, d_sn, s_se, s_sn, NB, KB,
        TOP_EXP: tl.constexpr, SPREAD: tl.constexpr, BIAS: tl.constexpr, NAN: tl.constexpr, T: tl.constexpr,
    ):  # fmt: skip
        """The tiles :func:`_mxfp4_fast_kernel` listed in ``marked_ptr`` (count, then flat tile
        indices), a grid-stride loop over the list, element by element (uint8 codes, int16 byte pairs
        out): their bytes, exact flag and largest |error| (fp64)."""
        for i in range(tl.program_id(0), tl.load(marked_ptr), tl.num_programs(0)):
            tile = tl.load(marked_ptr + 1 + i).to(tl.int64)
            e, bi, bj = tile // (NB * KB), (tile // KB) % NB, tile % KB
            top = tl.load(top_ptr + tile)
            empty = top <= -(1 << 20)
            t = tl.where(empty, 0, top - TOP_EXP)
            err, low = _mxfp4_tile_slow(d_ptr + e * d_se, s_ptr + e * s_se, q_ptr + e * N * KH, N, KH, d_sn, s_sn,
                                        t, bi, bj, BIAS, NAN, T)  # fmt: skip
            tl.store(exact_ptr + tile, (empty | (top - low <= SPREAD)).to(tl.int8))
            tl.store(err_ptr + tile, err.to(tl.float64) * _pow2_f64(t))

    @triton.jit
    def _float_tile_kernel(
        x_ptr, q_ptr, sinv_ptr, N, K, x_se, x_sn, NB, KB, EMAX: tl.constexpr, T: tl.constexpr,
    ):  # fmt: skip
        """Tile (pid0 = column tile, pid1 = row tile, pid2 = expert) of floats [E, N, K] -> E4M3
        bytes (uint8 [E, N, K]) and its scale_inv = amax / 448 (1 for a tile of zeros)."""
        bj, bi, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        rows = bi * T + tl.arange(0, T)
        cols = bj * T + tl.arange(0, T)
        ok = (rows < N)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + e * x_se + rows[:, None] * x_sn + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        sinv = tl.where(amax > 0, tl.math.div_rn(amax, tl.full((), EMAX, tl.float32)), 1.0)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, sinv), -EMAX), EMAX)
        tl.store(q_ptr + e * N * K + rows[:, None] * K + cols[None, :], _e4m3_bits(y).to(tl.uint8), mask=ok)
        tl.store(sinv_ptr + e * NB * KB + bi * KB + bj, sinv)


def _check(t: torch.Tensor) -> None:
    if triton is None:
        raise BadInput(f"triton is not importable: {TRITON_IMPORT_ERROR}")
    if not t.is_cuda and not triton_interpreter_on():
        raise BadInput("the Triton block-FP8 kernels need CUDA tensors (or TRITON_INTERPRET=1 for testing)")


def _rows_strided(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _words(t: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4m] with its last dim contiguous -> the same bytes as int32 [..., m] (a copy only
    where the strides or offset are not whole words)."""
    t = _rows_strided(t)
    try:
        return t.view(torch.int32)
    except RuntimeError:
        return t.contiguous().view(torch.int32)


def mxfp4_to_fp8_block_triton(data: torch.Tensor, scales: torch.Tensor) -> BlockFP8:
    """:func:`mxconv.mx.fp8_block.mxfp4_to_fp8_block` in two launches (all tiles with integer byte
    arithmetic, then the few whose elements fall below E4M3's normals or have NaN scales): MXFP4 uint8
    [E, N, K/2] + E8M0 uint8 [E, N, K/32] (rows may be a strided slice, the last dim contiguous) ->
    the same :class:`BlockFP8`."""
    _check(data)
    words, scales = _words(data), _rows_strided(scales)
    E, N, KW = words.shape
    nb, kb = tiles(N), tiles(KW * 8)
    q = torch.empty((E, N, KW * 8), dtype=torch.float8_e4m3fn, device=data.device)
    sinv, top = (torch.empty((E, nb, kb), dtype=torch.int32, device=data.device) for _ in range(2))
    exact = torch.empty((E, nb, kb), dtype=torch.int8, device=data.device)
    err = torch.empty((E, nb, kb), dtype=torch.float64, device=data.device)
    marked = torch.zeros(1 + E * nb * kb, dtype=torch.int32, device=data.device)  # count, tile indices
    if q.numel():
        consts = {"TOP_EXP": E4M3_TOP_EXP, "BIAS": E8M0_BIAS, "NAN": E8M0_NAN, "T": TILE}
        launch(
            _mxfp4_fast_kernel, (kb, nb, E), data, words, scales, q.view(torch.int64), sinv, exact, err, top, marked,
            N, KW // 4, words.stride(0), words.stride(1), scales.stride(0), scales.stride(1), nb, kb,
            num_warps=NUM_WARPS, **consts,
        )  # fmt: skip
        d8 = words.view(torch.uint8)
        launch(
            _mxfp4_slow_kernel, (min(E * nb * kb, SLOW_PROGRAMS),), data, d8, scales, q.view(torch.int16), exact,
            err, top, marked, N, KW * 4, d8.stride(0), d8.stride(1), scales.stride(0), scales.stride(1), nb, kb,
            SPREAD=MAX_EXACT_SPREAD, num_warps=SLOW_WARPS, **consts,
        )  # fmt: skip
    return BlockFP8(q, sinv.view(torch.float32), exact.view(torch.bool), err)


def float_to_fp8_block_triton(x: torch.Tensor) -> BlockFP8:
    """:func:`mxconv.mx.fp8_block.float_to_fp8_block` in one launch: floats [E, N, K] (the last dim
    contiguous) -> E4M3 [E, N, K] and fp32 scale_inv [E, ceil(N/128), ceil(K/128)]."""
    _check(x)
    x = _rows_strided(x)
    E, N, K = x.shape
    nb, kb = tiles(N), tiles(K)
    q = torch.empty((E, N, K), dtype=torch.float8_e4m3fn, device=x.device)
    sinv = torch.empty((E, nb, kb), dtype=torch.float32, device=x.device)
    if q.numel():
        launch(_float_tile_kernel, (kb, nb, E), x, x, q.view(torch.uint8), sinv, N, K, x.stride(0), x.stride(1), nb, kb,
               EMAX=E4M3_MAX, T=TILE, num_warps=FLOAT_WARPS)
    return BlockFP8(q, sinv)


__all__ = ["float_to_fp8_block_triton", "mxfp4_to_fp8_block_triton"]
