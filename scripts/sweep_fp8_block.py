#!/usr/bin/env python3
"""Launch-shape sweep of the MXFP4 -> block-FP8 fast kernel (issue 22 item 6) on a gpt-oss-120b
gate_up stack: each variant's bytes checked against the production kernel (itself checked against the
torch path on a few experts), timed with ``triton.testing.do_bench`` against a device copy.

    python scripts/sweep_fp8_block.py --json sweep.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from mxconv.kernels import fp8_block_triton as k
from mxconv.mx.fp8_block import mxfp4_to_fp8_block

E, N, K = 128, 5760, 2880


@triton.jit
def _prmt(a, b, c):
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.uint32,
                                     is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _prmt_bytes(h, tlo, thi):
    """4 codes in the low 16 bits of h -> 4 E4M3 bytes: magnitudes by table lookup (tlo, thi = the
    bytes of codes 0..7), sign bytes by PRMT's sign-replicate mode."""
    mag = _prmt(tlo, thi, h & 0x7777)
    sel = (h & 0x8888) | ((h >> 3) & 0x1111)  # 9: replicate byte 1's sign (0xFF), 0: byte 0 (0x00)
    sgn = _prmt(tl.full(h.shape, 0x8000, tl.uint32), tl.zeros(h.shape, tl.uint32), sel)
    return mag | (sgn & 0x80808080)


@triton.jit
def _grouped(
    d_ptr, s_ptr, q_ptr, sinv_ptr, exact_ptr, err_ptr, top_ptr,
    N, KW, KG, d_se, d_sn, s_se, s_sn, NB, KB,
    TOP_EXP: tl.constexpr, BIAS: tl.constexpr, NAN: tl.constexpr, T: tl.constexpr,
    CT: tl.constexpr, MEMONLY: tl.constexpr, PRMT: tl.constexpr = False, HINTS: tl.constexpr = False,
):  # fmt: skip
    """CT column tiles per program as [T, CT, 4 groups, 4 words]: one scale byte per group (no
    gather), the word keys reduced per group inside a thread, then per tile."""
    ct = tl.program_id(0) * CT + tl.arange(0, CT)
    bi, e = tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = bi * T + tl.arange(0, T)
    gcol = ct[:, None] * 4 + tl.arange(0, 4)[None, :]  # [CT, 4]
    wcol = gcol[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [CT, 4, 4]
    okg = (rows < N)[:, None, None] & (gcol < KG)[None, :, :]
    okw = okg[:, :, :, None]
    woff = rows[:, None, None, None] * d_sn + wcol[None, :, :, :]
    if HINTS:
        w = tl.load(d_ptr + e * d_se + woff, mask=okw, other=0, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    else:
        w = tl.load(d_ptr + e * d_se + woff, mask=okw, other=0).to(tl.uint32, bitcast=True)
    if MEMONLY:
        tl.store(q_ptr + e * N * KW + rows[:, None, None, None] * KW + wcol[None], w.to(tl.int64), mask=okw)
    else:
        sb = tl.load(s_ptr + e * s_se + rows[:, None, None] * s_sn + gcol[None], mask=okg, other=0).to(tl.int32)
        key = tl.max(k._word_key(w), axis=3)
        big = 1 << 20
        top = tl.max(tl.max(tl.where((key > 0) & (sb != NAN), sb + key, -big), axis=2), axis=0)
        smin = tl.min(tl.min(tl.where(okg & (sb == NAN), -big, tl.where(key > 0, sb, big)), axis=2), axis=0)
        top = tl.where(top <= -big, -big, top - BIAS - 2)
        t = tl.where(top <= -big, 0, top - TOP_EXP)
        tile = e * NB * KB + bi * KB + ct
        tm = ct < KB
        tl.store(sinv_ptr + tile, k._pow2_bits(t), mask=tm)
        tl.store(top_ptr + tile, top, mask=tm)
        fast = smin - BIAS - t >= -5
        base4 = (0x30 + 8 * (sb - BIAS - t[None, :, None])).to(tl.uint32, bitcast=True) * 0x01010101
        base4 = base4[:, :, :, None]
        if PRMT:
            tlo = (base4 + 0x0C080000) & 0xFFFFFF00
            thi = base4 + 0x1C181410
            lo = _prmt_bytes(w, tlo, thi).to(tl.uint64)
            hi = _prmt_bytes(w >> 16, tlo, thi).to(tl.uint64)
        else:
            lo = k._normal_bytes(k._nibbles(w & 0xFFFF), base4).to(tl.uint64)
            hi = k._normal_bytes(k._nibbles(w >> 16), base4).to(tl.uint64)
        out = (lo | (hi << 32)).to(tl.int64, bitcast=True)
        if HINTS:
            tl.store(q_ptr + e * N * KW + rows[:, None, None, None] * KW + wcol[None], out,
                     mask=okw & fast[None, :, None, None], cache_modifier=".cs")  # fmt: skip
        else:
            tl.store(q_ptr + e * N * KW + rows[:, None, None, None] * KW + wcol[None], out,
                     mask=okw & fast[None, :, None, None])  # fmt: skip
        tl.store(exact_ptr + tile, tl.where(fast, 1, 2).to(tl.int8), mask=tm)
        tl.store(err_ptr + tile, tl.zeros([CT], tl.float32), mask=tm & fast)


@triton.jit
def _flat_widen(src, dst, n, B: tl.constexpr):
    """The ceiling of this read:write mix: int32 words in, the same bits as int64 out, flat."""
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    tl.store(dst + i, tl.load(src + i, mask=i < n).to(tl.int64), mask=i < n)


def outputs(words: torch.Tensor, kb: int, nb: int):
    q = torch.zeros((E, N, K), dtype=torch.float8_e4m3fn, device="cuda")
    sinv, top = (torch.zeros((E, nb, kb), dtype=torch.int32, device="cuda") for _ in range(2))
    exact = torch.zeros((E, nb, kb), dtype=torch.int8, device="cuda")
    err = torch.zeros((E, nb, kb), dtype=torch.float64, device="cuda")
    return q, sinv, exact, err, top


def prod_fast(words, scales, o, warps):
    KW = words.shape[2]
    nb, kb = o[1].shape[1:]
    q, sinv, exact, err, top = o
    return lambda: k._mxfp4_fast_kernel[(kb, nb, E)](
        words, scales, q.view(torch.int64), sinv, exact, err, top, torch.zeros(1 + exact.numel(), dtype=torch.int32,
        device="cuda"), N, KW // 4, words.stride(0), words.stride(1),
        scales.stride(0), scales.stride(1), nb, kb, TOP_EXP=k.E4M3_TOP_EXP, BIAS=k.E8M0_BIAS, NAN=k.E8M0_NAN,
        T=k.TILE, num_warps=warps)  # fmt: skip


def grouped(words, scales, o, ct, warps, memonly=False, prmt=False, hints=False):
    KW = words.shape[2]
    nb, kb = o[1].shape[1:]
    q, sinv, exact, err, top = o
    return lambda: _grouped[(triton.cdiv(kb, ct), nb, E)](
        words, scales, q.view(torch.int64), sinv, exact, err, top, N, KW, KW // 4, words.stride(0),
        words.stride(1), scales.stride(0), scales.stride(1), nb, kb, TOP_EXP=k.E4M3_TOP_EXP,
        BIAS=k.E8M0_BIAS, NAN=k.E8M0_NAN, T=k.TILE, CT=ct, MEMONLY=memonly, PRMT=prmt, HINTS=hints, num_warps=warps)  # fmt: skip


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--lo", type=int, default=118)
    ap.add_argument("--hi", type=int, default=125)
    a = ap.parse_args()
    torch.manual_seed(0)
    data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(a.lo, a.hi + 1, (E, N, K // 32), dtype=torch.uint8, device="cuda")
    words = data.view(torch.int32)
    nb, kb = -(-N // 128), -(-K // 128)
    moved = data.numel() + scales.numel() + E * N * K + 4 * E * nb * kb
    buf = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    copy = ms(lambda b=buf, d=dst: d.copy_(b))
    del buf, dst
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "copy_ms": copy, "rows": {}}
    ref = mxfp4_to_fp8_block(data[:1].cpu(), scales[:1].cpu())
    full = k.mxfp4_to_fp8_block_triton(data, scales)
    res["prod_equals_torch_1_expert"] = bool(
        torch.equal(full.data[:1].cpu().view(torch.uint8), ref.data.view(torch.uint8))
        and torch.equal(full.scale_inv[:1].cpu(), ref.scale_inv))
    res["rows"]["prod wrapper (both launches + host ops)"] = ms(lambda: k.mxfp4_to_fp8_block_triton(data, scales))
    s2 = torch.randint(108, 126, scales.shape, dtype=torch.uint8, device="cuda")
    res["rows"]["prod wrapper, scale bytes 108..125"] = ms(lambda s=s2: k.mxfp4_to_fp8_block_triton(data, s))
    del s2
    want = full.data.view(torch.uint8)
    want_s = full.scale_inv.view(torch.int32)
    widen = ms(lambda: data.to(torch.int16))  # reads the codes once, writes twice their bytes
    res["rows"]["torch uint8->int16 (same read:write mix)"] = {"ms": widen, "of_copy": copy / widen * 3 * data.numel() / moved}
    variants = {f"prod fast w{w}": (lambda o, w=w: prod_fast(words, scales, o, w)) for w in (4, 8)}
    variants["grouped+prmt CT2 w8"] = lambda o: grouped(words, scales, o, 2, 8, prmt=True)
    for b in (1024, 4096):
        variants[f"flat widen B{b}"] = lambda o, b=b: (lambda: _flat_widen[(triton.cdiv(words.numel(), b),)](
            words, o[0].view(torch.int64), words.numel(), B=b, num_warps=8))
    for ct in (1, 4):
        variants[f"memonly CT{ct} w8"] = lambda o, ct=ct: grouped(words, scales, o, ct, 8, True)
    for name, make in variants.items():
        o = outputs(words, kb, nb)
        try:
            fn = make(o)
            fn()
            torch.cuda.synchronize()
            same = "memonly" in name or "flat" in name or (torch.equal(o[0].view(torch.uint8), want) and torch.equal(o[1], want_s)
                                         and bool((o[2] == 1).all()))  # fmt: skip
            t = ms(fn)
            res["rows"][name] = {"ms": t, "of_copy": copy / t, "bytes_equal": same}
        except Exception as exc:  # noqa: BLE001 - a sweep row that fails to compile is reported
            res["rows"][name] = {"error": repr(exc)[:300]}
        print(name, res["rows"][name], flush=True)
        del o
    x = torch.randn((E, N, K), dtype=torch.bfloat16, device="cuda")
    movedf = 3 * x.numel() + 4 * E * nb * kb
    buf = torch.empty(movedf // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    copyf = ms(lambda b=buf, d=dst: d.copy_(b))
    del buf, dst
    base = k.float_to_fp8_block_triton(x)
    res["bf16_copy_ms"] = copyf
    for w in (16,):
        k.FLOAT_WARPS = w
        r = k.float_to_fp8_block_triton(x)
        same = torch.equal(r.data.view(torch.uint8), base.data.view(torch.uint8)) and torch.equal(r.scale_inv, base.scale_inv)
        t = ms(lambda: k.float_to_fp8_block_triton(x))
        res["rows"][f"bf16 w{w}"] = {"ms": t, "of_copy": copyf / t, "bytes_equal_w8": same}
        print(f"bf16 w{w}", res["rows"][f"bf16 w{w}"], flush=True)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
