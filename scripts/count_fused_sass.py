#!/usr/bin/env python3
"""Count the SASS instructions of the fused bf16 -> ``triton`` kernel's column loop, compiled for
sm_90 on a machine without a GPU (Triton's own ptxas and nvdisasm; docs/benchmarks.md, session 5).

The kernel is compiled as ``fused_hopper_values`` launches it for gpt-oss-120b (the pointer and
stride arguments divisible by 16, ``KERNEL_CONFIG``'s shape, an 8-warp scale layout), once on the
bf16x2 path and once on the fp32 path; every scale rule is compiled too (ptxas refuses bad PTX).
Per path it prints the whole kernel's and the column loop's static instruction counts (the fp32
path's loop includes the subnormal rebuild it branches around), registers and stack, and the most
frequent opcodes. Use the Triton the GPU machine has (3.6) for figures that match it:

    pip install --no-deps --target /tmp/tri36 triton==3.6.0
    PYTHONPATH=/tmp/tri36:src python scripts/count_fused_sass.py [--sass-dir /tmp]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mxconv.kernels import triton_fused
from mxconv.mx.formats import FORMAT_PARAMS, SUBNORMAL_FIX_MAX_BYTE

ARGS = {"src": "*i32", "dst": "*i32", "scale": "*u8", "flag": "*i32", "tab": "*i32", "C_in": "i32", "Q_out": "i32",
        "N16": "i32", "NS32": "i32", "s_e": "i64", "s_r": "i64", "d_e": "i64", "d_r": "i64", "c_e": "i64", "c_r": "i64"}  # fmt: skip
DIVISIBLE_BY_16 = ("src", "dst", "scale", "flag", "tab", "Q_out", "s_e", "s_r", "d_e", "d_r", "c_e", "c_r")


def compile_fused(packed: bool, mode: int = 0, scale_warps: int = 8) -> triton.compiler.CompiledKernel:
    """The kernel for bf16 input (``packed``: the bf16x2 path), scale rule ``mode``, on sm_90."""
    cfg = triton_fused.KERNEL_CONFIG
    p = FORMAT_PARAMS["mxfp4"]
    consts = {"INPUT_KIND": 1, "MODE": mode, "EMAX": p.emax, "RCEIL_MANT_T": p.rceil_mant_threshold,
              "RCEIL_MIN_BITS": p.rceil_min_bits_byte1, "EVEN_ADD": p.even_round_add, "FIX_MAX_BYTE": SUBNORMAL_FIX_MAX_BYTE,
              "PACKED": packed, "SW": scale_warps, "BR0": cfg["BR0"], "BR1": cfg["BR1"], "ITERS": cfg["ITERS"]}  # fmt: skip
    sig = dict(ARGS, **{k: "constexpr" for k in consts})
    names = list(sig)
    src = ASTSource(triton_fused._fused_value_kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in DIVISIBLE_BY_16})  # fmt: skip
    options = {"num_warps": cfg["num_warps"], **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def summary(kernel: triton.compiler.CompiledKernel, sass_path: str | None) -> dict[str, object]:
    """Instruction counts (kernel, loop body), resources and top opcodes of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    if sass_path:
        with open(sass_path, "w") as out:
            out.write(sass)
    lines = sass.splitlines()
    ins = [i for i, line in enumerate(lines) if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.L_x_\d+:", line)}
    backward = [(labels[m.group(1)], i) for i, line in enumerate(lines)
                if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]  # fmt: skip
    start, back = max(backward, key=lambda span: span[1] - span[0], default=(0, -1))  # the outer (column) loop
    loop = sum(1 for i in ins if start < i <= back)
    ops = collections.Counter(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", lines[i]).split()[0].split(".")[0] for i in ins)
    return {"instructions": len(ins), "loop_body_static": loop, "resources": re.findall(r"REG:\d+|STACK:\d+|LOCAL:\d+", usage),
            "top_opcodes": ops.most_common(12)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sass-dir", help="also write each path's SASS there")
    a = ap.parse_args()
    print("triton", triton.__version__, "launch shape", triton_fused.KERNEL_CONFIG)
    for mode in (1, 2):  # floor, even: the saturating PTX block
        compile_fused(True, mode)
    for packed in (True, False):
        path = os.path.join(a.sass_dir, f"fused_{'bf16x2' if packed else 'fp32'}.sass") if a.sass_dir else None
        print("bf16x2 path" if packed else "fp32 path", summary(compile_fused(packed), path))


if __name__ == "__main__":
    main()
