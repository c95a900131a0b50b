"""Triton kernels: bf16/fp16/fp32 [..., K] -> MXFP4 (packed E2M1 + E8M0) or MXFP8 (E4M3 + E8M0).

One launch covers a whole stack (e.g. [E, N, K] experts): the input is seen as a flat run of
32-element blocks; a tile is ``BLOCKS`` consecutive blocks and each program does ``ITERS`` tiles.

The bytes are those of :func:`mxconv.mx.numerics.quantize_mx_torch` (see its module docstring for the
rules); every constant comes from ``mxconv.mx.numerics``. Implementation notes:

* Elements are loaded as *pairs* packed in one machine word (two bf16/fp16 in an int32, two fp32 in an
  int64): element ``2i`` is the low half, ``2i+1`` the high half. Tiles are [BLOCKS, 16] words, so the
  packed FP4 byte ``code(2i) | code(2i+1) << 4`` and the E4M3 byte pair are formed per thread with no
  data exchange, and loads/stores are contiguous and vectorised.
* bf16 and fp32 inputs are read as raw bits. The block max is a float max of ``|x|`` (exact; if the
  GPU flushes a subnormal max to zero the byte is 0 either way), and the scale byte is integer
  arithmetic on its bit pattern.
* E2M1 rounding is one fp32 add of a "magic" power of two ``2^(22+t)`` whose ulp equals the E2M1
  step in ``|y|``'s binade (0.5 below 2, 1 in [2, 4), 2 in [4, 8)): the FPU rounds to nearest-even
  with exact sticky bits, and the code is read from the sum's low mantissa bits.
* E4M3: ``.to(tl.float8e4nv)``, i.e. ``cvt.rn.satfinite.e4m3x2.f32`` on SM89+, which rounds to
  nearest-even and saturates finite overflow to +-448 itself (the torch path clamps first because
  older torch casts do not saturate). No clamp here: see ``_e4m3_byte``.
* Triton on NVIDIA flushes fp32 subnormals in float ops; blocks whose scale byte is at most
  ``SUBNORMAL_FIX_MAX_BYTE`` (only tiny blocks) rebuild subnormal inputs from their mantissa integer,
  as the torch path does. A tile only takes that branch when one of its blocks needs it.
"""

from __future__ import annotations

import functools

import torch

from mxconv.environment import triton_interpreter_on
from mxconv.errors import BadInput
from mxconv.kernels.triton_common import launch
from mxconv.kernels.triton_import import TRITON_IMPORT_ERROR, tl, triton
from mxconv.mx.formats import (
    BLOCK_SIZE,
    E8M0_BIAS,
    E8M0_MAX_FINITE,
    FORMAT_PARAMS,
    SCALE_MODE_IDS,
    SUBNORMAL_FIX_MAX_BYTE,
    check_args,
)

# Default launch shape (tuned on H100/H200 with scripts/bench_quantize.py).
DEFAULT_BLOCKS_PER_PROGRAM = 128
DEFAULT_NUM_WARPS = 4
DEFAULT_TILES_PER_PROGRAM = 1


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when triton imports and a CUDA device is present (the kernels' production target)."""
    return TRITON_IMPORT_ERROR is None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def scaled_elements(xb, byte, need_fix, FIX_MAX_BYTE: tl.constexpr):
        """y = x * 2^-e per block, exact; subnormal x rebuilt from its mantissa in low-byte blocks.

        xb: int32 [B, n] fp32 bit patterns; byte: int32 [B] in [0, 253]. Returns fp32 [B, n].
        """
        mult = ((2 * 127 - byte) << 23).to(tl.float32, bitcast=True)  # 2^-e, a normal fp32
        y = xb.to(tl.float32, bitcast=True) * mult[:, None]
        if need_fix:
            low = (byte <= FIX_MAX_BYTE)[:, None]
            sub = ((xb & 0x7F800000) == 0) & low
            # 2^(-149-e) as fp32 bits: exponent field 127 - 149 - (byte - 127) = 105 - byte
            sub_mult = (tl.maximum(105 - byte, 1) << 23).to(tl.float32, bitcast=True)
            mag = (xb & 0x007FFFFF).to(tl.float32) * sub_mult[:, None]
            sign = (xb >> 31) << 31
            exact = (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
            y = tl.where(sub, exact, y)
        return y

    @triton.jit
    def _e2m1_magnitude(y, SATURATE: tl.constexpr):
        """E2M1 magnitude code (int32 0..7) of |y|: RNE through one fp32 add, saturating at 6.

        The magic addend 2^(22+t) (t = 0, 1, 2 for |y| < 2, [2, 4), >= 4) has an ulp equal to the
        E2M1 step there (0.5, 1, 2), so ``|y| + magic`` is rounded by the FPU (ties to even, sticky
        bits exact) and its mantissa counts steps; the code is that count plus 2t.
        """
        ay = tl.abs(y)
        e_bits = tl.maximum(ay, 1.0).to(tl.int32, bitcast=True) & 0x7F800000  # 2^t as fp32 bits
        magic = e_bits.to(tl.float32, bitcast=True) * 4194304.0  # 2^(22+t), exact
        s = ay + magic
        code = s.to(tl.int32, bitcast=True) - magic.to(tl.int32, bitcast=True) + ((e_bits >> 22) - 254)
        if SATURATE:  # only floor/even can round above 6 (rceil maps the block max to <= 6)
            code = tl.minimum(code, 7)
        return code

    @triton.jit
    def _e4m3_byte(y):
        """E4M3 bit pattern (int32 0..255) of fp32 y: RNE, saturating at +-448.

        The cast is ``cvt.rn.satfinite.e4m3x2.f32``, which saturates by itself, so no clamp is applied
        first: with a clamp to +-448 (float min/max, or an integer min on the bits) placed here, the
        kernel wrote wrong bytes for about a quarter of the elements in floor/even mode on an H100
        (Triton 3.6); the root cause was not isolated. tests/test_triton_kernels.py checks saturation
        on the GPU.
        """
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)

    @triton.jit
    def split_pairs(w, INPUT_KIND: tl.constexpr):
        """The even (low half) and odd (high half) element of each pair word, as fp32 bits (int32)."""
        if INPUT_KIND == 0:
            xe = w.to(tl.int32)
            xo = (w >> 32).to(tl.int32)
        elif INPUT_KIND == 1:
            xe = w << 16
            xo = w & -65536
        else:
            xe = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
            xo = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
        return xe, xo

    @triton.jit
    def scale_byte(
        amax, MODE: tl.constexpr, EMAX: tl.constexpr, RCEIL_MANT_T: tl.constexpr, RCEIL_MIN_BITS: tl.constexpr,
        EVEN_ADD: tl.constexpr,
    ):  # fmt: skip
        """The E8M0 byte (int32) of a block from the fp32 bits of its max |x| (a flushed subnormal
        max gives byte 0 too)."""
        exp_field = amax >> 23
        if MODE == 0:
            e = exp_field - (127 + EMAX) + ((amax & 0x007FFFFF) > RCEIL_MANT_T).to(tl.int32)
            e = tl.where(amax < RCEIL_MIN_BITS, -127, e)
        elif MODE == 1:
            e = exp_field - (127 + EMAX)
        else:
            e = ((amax + EVEN_ADD) >> 23) - (127 + EMAX)
        return tl.minimum(tl.maximum(e + 127, 0), 254)

    @triton.jit
    def block_scaled(
        w, valid, INPUT_KIND: tl.constexpr, MODE: tl.constexpr, EMAX: tl.constexpr, RCEIL_MANT_T: tl.constexpr,
        RCEIL_MIN_BITS: tl.constexpr, EVEN_ADD: tl.constexpr, FIX_MAX_BYTE: tl.constexpr,
    ):  # fmt: skip
        """The block math up to the element codes, on loaded words: ``w`` [B, 16] element pairs (int32
        for bf16/fp16, int64 for fp32) of B blocks, ``valid`` [B] the blocks that hold data (others
        need no subnormal fix).

        Returns (xe, xo, ye, yo, byte, mag): the even / odd elements as fp32 bits (int32 [B, 16]) and
        scaled by 2^-e (fp32 [B, 16]); byte int32 [B], the E8M0 scale; mag int32 [B], an integer max
        of |x|'s fp32 bits, >= 0x7F800000 iff the block holds a NaN or an Inf (float max drops NaN;
        unused results cost nothing: the compiler drops what no store reads)."""
        xe, xo = split_pairs(w, INPUT_KIND)
        mag = tl.max(tl.maximum(xe & 0x7FFFFFFF, xo & 0x7FFFFFFF), axis=1)
        amax_f = tl.maximum(
            tl.max(tl.abs(xe.to(tl.float32, bitcast=True)), axis=1),
            tl.max(tl.abs(xo.to(tl.float32, bitcast=True)), axis=1),
        )
        byte = scale_byte(amax_f.to(tl.int32, bitcast=True), MODE, EMAX, RCEIL_MANT_T, RCEIL_MIN_BITS, EVEN_ADD)
        need_fix = tl.min(tl.where(valid, byte, 255)) <= FIX_MAX_BYTE
        ye = scaled_elements(xe, byte, need_fix, FIX_MAX_BYTE)
        yo = scaled_elements(xo, byte, need_fix, FIX_MAX_BYTE)
        return xe, xo, ye, yo, byte, mag

    @triton.jit
    def fp4_magnitudes(ye, yo, MODE: tl.constexpr):
        """The two E2M1 magnitude codes (0..7) of each pair of :func:`block_scaled`'s scaled elements."""
        return _e2m1_magnitude(ye, MODE != 0), _e2m1_magnitude(yo, MODE != 0)

    @triton.jit
    def quantize_block_words(
        w, valid, INPUT_KIND: tl.constexpr, IS_FP4: tl.constexpr, MODE: tl.constexpr, EMAX: tl.constexpr,
        RCEIL_MANT_T: tl.constexpr, RCEIL_MIN_BITS: tl.constexpr, EVEN_ADD: tl.constexpr, FIX_MAX_BYTE: tl.constexpr,
    ):  # fmt: skip
        """:func:`block_scaled` then the element bytes. Returns (out, byte, mag): out int32 [B, 16], the
        packed FP4 byte (mxfp4) or the E4M3 byte pair (mxfp8) of each pair; byte and mag as there."""
        xe, xo, ye, yo, byte, mag = block_scaled(
            w, valid, INPUT_KIND, MODE, EMAX, RCEIL_MANT_T, RCEIL_MIN_BITS, EVEN_ADD, FIX_MAX_BYTE
        )
        if IS_FP4:
            me, mo = fp4_magnitudes(ye, yo, MODE)
            packed = me | (mo << 4)
            if INPUT_KIND == 0:
                sign = ((xe >> 28) & 0x8) | ((xo >> 24) & 0x80)
            else:  # 16-bit halves: sign bits 15 and 31 of the word -> bits 3 and 7 (bit 19 is cut off)
                sign = (w >> 12) & 0x80008
                sign = sign | (sign >> 12)
            out = packed | sign
        else:
            out = _e4m3_byte(ye) | (_e4m3_byte(yo) << 8)
        return out, byte, mag

    @triton.jit
    def _quantize_tile(
        x_ptr, data_ptr, scale_ptr, flag_ptr, first, n_blocks,
        INPUT_KIND: tl.constexpr, IS_FP4: tl.constexpr, MODE: tl.constexpr, EMAX: tl.constexpr,
        RCEIL_MANT_T: tl.constexpr, RCEIL_MIN_BITS: tl.constexpr, EVEN_ADD: tl.constexpr,
        FIX_MAX_BYTE: tl.constexpr, BLOCKS: tl.constexpr, FLAG: tl.constexpr,
    ):  # fmt: skip
        """Quantize blocks [first, first + BLOCKS) (masked at n_blocks); FLAG: store 1 at flag_ptr
        when one of them holds a NaN or an Inf (all-ones exponent in the fp32 bits)."""
        rows = tl.arange(0, BLOCKS)
        pairs = tl.arange(0, 16)
        row_ok = rows < (n_blocks - first)
        offs = rows[:, None] * 16 + pairs[None, :]
        mask = row_ok[:, None]
        w = tl.load((x_ptr + first * 16) + offs, mask=mask, other=0, eviction_policy="evict_first")
        out, byte, mag = quantize_block_words(
            w, row_ok, INPUT_KIND, IS_FP4, MODE, EMAX, RCEIL_MANT_T, RCEIL_MIN_BITS, EVEN_ADD, FIX_MAX_BYTE
        )
        if FLAG:  # no cross-warp reduction: every block with a NaN/Inf stores the 1
            tl.store(flag_ptr + rows * 0, 1, mask=row_ok & (mag >= 0x7F800000))
        if IS_FP4:
            tl.store((data_ptr + first * 16) + offs, out.to(tl.uint8), mask=mask)
        else:
            tl.store((data_ptr + first * 16) + offs, out.to(tl.int16), mask=mask)
        tl.store((scale_ptr + first) + rows, byte.to(tl.uint8), mask=row_ok)

    @triton.jit
    def _mx_quantize_kernel(
        x_ptr,  # int32 words (bf16/fp16 pairs) or int64 words (fp32 pairs), [n_blocks * 16]
        data_ptr,  # uint8 [n_blocks * 16] (mxfp4) or int16 [n_blocks * 16] (mxfp8 byte pairs)
        scale_ptr,  # uint8 [n_blocks]
        flag_ptr,  # int32 [1]: set to 1 when an input element is NaN/Inf (FLAG only)
        n_blocks,
        INPUT_KIND: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
        IS_FP4: tl.constexpr,
        MODE: tl.constexpr,  # 0 rceil, 1 floor, 2 even
        EMAX: tl.constexpr,
        RCEIL_MANT_T: tl.constexpr,
        RCEIL_MIN_BITS: tl.constexpr,
        EVEN_ADD: tl.constexpr,
        FIX_MAX_BYTE: tl.constexpr,
        BLOCKS: tl.constexpr,  # 32-element blocks per tile
        ITERS: tl.constexpr,  # tiles per program
        FLAG: tl.constexpr,  # write flag_ptr
    ):
        pid = tl.program_id(0).to(tl.int64)
        for it in tl.static_range(ITERS):
            _quantize_tile(
                x_ptr, data_ptr, scale_ptr, flag_ptr, (pid * ITERS + it) * BLOCKS, n_blocks,
                INPUT_KIND, IS_FP4, MODE, EMAX, RCEIL_MANT_T, RCEIL_MIN_BITS, EVEN_ADD,
                FIX_MAX_BYTE, BLOCKS, FLAG,
            )  # fmt: skip


_INPUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _outputs(x: torch.Tensor, data_shape: tuple[int, ...], scale_shape: tuple[int, ...],
             out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernel's (data, scales): new tensors, or ``out`` once checked (contiguous uint8 of the shapes)."""
    if out is None:
        return (torch.empty(data_shape, dtype=torch.uint8, device=x.device),
                torch.empty(scale_shape, dtype=torch.uint8, device=x.device))  # fmt: skip
    for t, shape, what in zip(out, (data_shape, scale_shape), ("data", "scales")):
        if tuple(t.shape) != shape or t.dtype != torch.uint8 or not t.is_contiguous() or t.device != x.device:
            raise BadInput(f"quantize_mx_triton: out {what} must be contiguous uint8 {list(shape)} on {x.device}, "
                           f"got {t.dtype}{list(t.shape)} on {t.device}")  # fmt: skip
    return out


def quantize_mx_triton(
    x: torch.Tensor,
    fmt: str,
    scale_rounding: str = "rceil",
    *,
    blocks_per_program: int = DEFAULT_BLOCKS_PER_PROGRAM,
    num_warps: int = DEFAULT_NUM_WARPS,
    tiles_per_program: int = DEFAULT_TILES_PER_PROGRAM,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    nonfinite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] (bf16/fp16/fp32 on CUDA) to MX in one kernel launch.

    Returns ``(data, scales)`` exactly as :func:`mxconv.mx.numerics.quantize_mx_torch`:
    mxfp4 data uint8 [..., K/2] (low nibble = even element), mxfp8 data uint8 [..., K] (E4M3 bits),
    scales uint8 [..., K/32] (E8M0). CPU tensors are accepted only under ``TRITON_INTERPRET=1``
    (whose fp32->fp8 cast is not exact: trust its MXFP8 scales, not its MXFP8 elements).
    ``out``: contiguous ``(data, scales)`` of those shapes on x's device to write into (no new
    buffers, no copy). ``nonfinite``: an int32 tensor whose first element the kernel sets to 1
    when any element of ``x`` is NaN or Inf (left as is otherwise; the bytes of such blocks are
    not the torch path's) - the finiteness scan folded into the one read of ``x``.
    """
    check_args(x, fmt, scale_rounding)
    if triton is None:
        raise BadInput(f"triton is not importable: {TRITON_IMPORT_ERROR}")
    if not x.is_cuda and not triton_interpreter_on():
        raise BadInput("the Triton MX quantizer needs a CUDA tensor (or TRITON_INTERPRET=1 for testing)")
    if blocks_per_program <= 0 or blocks_per_program & (blocks_per_program - 1):
        raise BadInput(f"blocks_per_program must be a power of two, got {blocks_per_program}")
    if tiles_per_program <= 0:
        raise BadInput(f"tiles_per_program must be positive, got {tiles_per_program}")
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    nb = k // BLOCK_SIZE
    data, scales = _outputs(x, lead + ((k // 2) if fmt == "mxfp4" else k,), lead + (nb,), out)
    if nonfinite is not None and (nonfinite.dtype != torch.int32 or nonfinite.device != x.device):
        raise BadInput(f"nonfinite must be an int32 tensor on {x.device}, got {nonfinite.dtype} on {nonfinite.device}")
    n_blocks = x.numel() // BLOCK_SIZE
    if n_blocks == 0:
        return data, scales
    xc = x.contiguous()
    word_dtype = torch.int64 if x.dtype == torch.float32 else torch.int32  # two elements per word
    try:
        words = xc.view(word_dtype)
    except RuntimeError:  # storage offset not a whole number of words
        words = xc.clone().view(word_dtype)
    out_words = data if fmt == "mxfp4" else data.view(torch.int16)
    p = FORMAT_PARAMS[fmt]
    assert E8M0_MAX_FINITE == 254 and E8M0_BIAS == 127  # baked into the kernel's integer constants
    grid = (triton.cdiv(n_blocks, blocks_per_program * tiles_per_program),)
    launch(
        _mx_quantize_kernel, grid, x,
        words,
        out_words,
        scales,
        scales if nonfinite is None else nonfinite,
        n_blocks,
        INPUT_KIND=_INPUT_KINDS[x.dtype],
        IS_FP4=fmt == "mxfp4",
        MODE=SCALE_MODE_IDS[scale_rounding],
        EMAX=p.emax,
        RCEIL_MANT_T=p.rceil_mant_threshold,
        RCEIL_MIN_BITS=p.rceil_min_bits_byte1,
        EVEN_ADD=p.even_round_add,
        FIX_MAX_BYTE=SUBNORMAL_FIX_MAX_BYTE,
        BLOCKS=blocks_per_program,
        ITERS=tiles_per_program,
        FLAG=nonfinite is not None,
        num_warps=num_warps,
    )
    return data, scales


__all__ = ["quantize_mx_triton", "triton_available"]
