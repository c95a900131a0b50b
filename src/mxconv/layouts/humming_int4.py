"""INT4 variant of the "humming" layout (docs/layout-humming.md, "Compressed-tensors INT4"): what vLLM
0.33 holds for HUMMING on SM90 after ``CompressedTensorsWNA16MoEMethod.process_weights_after_loading``
-> ``convert_to_wna16_moe_kernel_format`` (``fused_moe/oracle/int_wna16.py``) ->
``convert_to_humming_moe_kernel_format`` with the compressed-tensors schema
(``_humming_wna16_weight_schema``: pack-quantized, int, 4 bits, group 32, symmetric).

:data:`INT4` (a :class:`HummingInt4`) is the part of the form :class:`mxconv.layouts.humming.HummingLayout`
declares for a canonical stack whose ``weight_format`` is "int4" (the MX ones are
:mod:`mxconv.layouts.humming_mx`'s); the layout's ``int4_codes`` option reaches it as ``codes``. Input: canonical int4 (``mxconv.mx.int4``: offset-binary bytes ``[E, N, K/2]``, bf16 scales
``[E, N, K/32]``, rows "halves", no bias). Per layer, GEMM (w13, w2) and TP rank:

1. no vLLM padding (the WNA16 method has no ``maybe_roundup_sizes``): H and I per rank multiples of 32;
2. codes: humming's ``convert_symmetric_integer_weight`` (``schema/humming.py``) keeps the
   offset-binary codes ("uint4") when any code of the GEMM's whole stack is 0 (q = -8); otherwise it
   rewrites every code to sign-magnitude ``|q| | (q < 0) << 3`` and the weight type becomes
   ``float4e0m3`` ("e0m3"). vLLM decides nothing from the config here: the choice is made per layer,
   per GEMM and per TP rank (the stack one rank loads), from the codes alone. The ``int4_codes``
   option "auto" (the default) makes the same choice per stack (:func:`stack_codes`), and the run
   records it in the manifest (``layout.stack_choices``, per layer, rank and weight tensor) for verify
   and the loader to invert with; "uint4" or "e0m3" names the form for every stack, and a stack for
   which humming would pick the other is refused;
3. humming's padding (N to 256, K to 128, appended, zero codes and bf16 zero scales), then the same
   weight repack and scale permutation as MXFP4 (``humming_bytemap``): scales stay bfloat16.

| name             | shape              | dtype    |
|------------------|--------------------|----------|
| w13_weight       | [E, K13/16, 2*N13] | int32, N13 = roundup(2I, 256), K13 = roundup(H, 128) |
| w13_weight_scale | [E, K13/32, N13]   | bfloat16 |
| w2_weight        | [E, K2/16, 2*N2]   | int32, N2 = roundup(H, 256), K2 = roundup(I, 128) |
| w2_weight_scale  | [E, K2/32, N2]     | bfloat16 |

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from mxconv.errors import LayoutError
from mxconv.experts.padding import check_fill
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.experts.tensors import KernelTensors, TensorSpec
from mxconv.layouts.humming_bytemap import (
    gemm_shapes, lay_out_scales, pad_matrix, repack_weights, unlay_scales, unrepack_weights,
)

if TYPE_CHECKING:
    import torch

WEIGHT_FORMAT = "int4"
GROUP_SIZE = 32
ROW_ORDER = "halves"
AUTO = "auto"  # the int4_codes option's default: per stack, as humming chooses
FORMS = ("uint4", "e0m3")  # the code forms humming leaves a stack in
CODES = (AUTO, *FORMS)  # the int4_codes option's values
WEIGHTS = ("w13_weight", "w2_weight")  # the tensors a choice is recorded for (one per GEMM)
B_DTYPES = {"uint4": "uint4", "e0m3": "float4e0m3"}  # humming LayerConfig b_dtype per code form
BIAS_REFUSAL = "humming INT4 takes no expert biases (compressed-tensors INT4 experts have none)"


def padded_sizes(hidden_size: int, intermediate_size: int, row_order: str) -> tuple[int, int]:
    """(Hp, Ip) = (H, I): LayoutError unless both are positive multiples of 32 (vLLM's WNA16 method
    requires group-aligned H and per-rank I) and w13 rows are in halves order ([gate; up])."""
    if row_order != ROW_ORDER:
        raise LayoutError(f"humming INT4 takes w13 rows in {ROW_ORDER!r} order ([gate; up]), got {row_order!r}")
    for what, size in (("hidden", hidden_size), ("intermediate (per TP rank)", intermediate_size)):
        if size <= 0 or size % GROUP_SIZE:
            raise LayoutError(f"humming INT4: {what} size {size} must be a positive multiple of {GROUP_SIZE} "
                              "(vLLM's compressed-tensors WNA16 MoE method needs whole scale groups)")  # fmt: skip
    return hidden_size, intermediate_size


def kernel_specs(sizes: LayoutSizes) -> dict[str, TensorSpec]:
    """Shapes/dtypes of the stored INT4 tensors (module table)."""
    if (sizes.padded_hidden_size, sizes.padded_intermediate_size) != padded_sizes(
            sizes.hidden_size, sizes.intermediate_size, sizes.row_order):  # fmt: skip
        raise LayoutError("humming INT4: padded sizes must equal (H, I) (vLLM pads nothing for INT4)")
    if sizes.has_bias:
        raise LayoutError(BIAS_REFUSAL)
    E, specs = sizes.num_experts, {}
    for w, (_n, _k, n_pad, k_pad) in gemm_shapes(sizes.hidden_size, sizes.intermediate_size).items():
        specs[f"{w}_weight"] = TensorSpec((E, k_pad // 16, 2 * n_pad), "I32")
        specs[f"{w}_weight_scale"] = TensorSpec((E, k_pad // GROUP_SIZE, n_pad), "BF16")
    return specs


def _nibbles(data: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.stack((data & 0xF, data >> 4), dim=-1)


def _code_table(codes: str, inverse: bool) -> list[int]:
    """Nibble map offset-binary -> stored codes (or back). e0m3: s = q + 8 -> |q| | (q < 0) << 3."""
    if codes == "uint4":
        return list(range(16))
    fwd = [abs(s - 8) | ((s < 8) << 3) for s in range(16)]
    fwd[0] = 0  # q = -8 has no e0m3 code; humming never converts a stack holding it (checked before)
    if not inverse:
        return fwd
    back = [0] * 16
    for s in range(1, 16):
        back[fwd[s]] = s
    back[8] = 0  # "-0" is never written; mapping it to q = -8 makes a planted one fail verify
    return back


def recode(data: torch.Tensor, codes: str, inverse: bool = False) -> torch.Tensor:
    """uint8 [..., K/2] nibble pairs through :func:`_code_table` (each nibble on its own)."""
    import torch

    table = torch.tensor(_code_table(codes, inverse), dtype=torch.uint8, device=data.device)
    nib = table[_nibbles(data).long()]
    return (nib[..., 0] | (nib[..., 1] << 4)).contiguous()


def humming_codes(data: torch.Tensor) -> str:
    """The code form humming's ``convert_symmetric_integer_weight`` gives a GEMM's whole stack:
    "uint4" if any nibble is 0 (q = -8), else "e0m3"."""
    return "uint4" if bool((_nibbles(data) == 0).any()) else "e0m3"


def stack_codes(c: CanonicalExperts, option: str | Mapping[str, str]) -> dict[str, str]:
    """The code form of each GEMM's stack of ``c`` under the ``int4_codes`` value ``option``, by
    weight tensor name: humming's choice from the codes for "auto", the named form otherwise; a
    mapping (forms already chosen, e.g. read back from a manifest) is taken as it is."""
    if not isinstance(option, str):
        return {w: option[w] for w in WEIGHTS}
    return {f"{w}_weight": humming_codes(getattr(c, w)) if option == AUTO else option for w in ("w13", "w2")}


def _check_codes(name: str, data: torch.Tensor, codes: str) -> None:
    found = humming_codes(data)
    if found == codes:
        return
    if codes == "e0m3":
        where = [int(i) for i in (_nibbles(data) == 0).nonzero()[0].tolist()]
        raise LayoutError(
            f"{name}: the code q = -8 at [expert, row, byte, nibble] {where} makes humming keep offset-binary "
            "uint4 codes for this GEMM (convert_symmetric_integer_weight), not float4e0m3; int4_codes=auto "
            "chooses per stack as humming does")
    raise LayoutError(
        f"{name}: no code of this stack is q = -8, so humming rewrites it to sign-magnitude float4e0m3 "
        "(convert_symmetric_integer_weight), not uint4; int4_codes=auto chooses per stack as humming does")


def to_kernel(c: CanonicalExperts, codes: str | Mapping[str, str]) -> KernelTensors:
    """Canonical int4 stack -> stored tensors (module table) on ``c``'s device, each GEMM in the
    form :func:`stack_codes` gives (LayoutError where humming would leave that stack in the other)."""
    import torch

    c.validate()
    if c.w13_bias is not None:
        raise LayoutError(BIAS_REFUSAL)
    padded_sizes(c.hidden_size, c.intermediate_size, c.row_order)
    out: KernelTensors = {}
    forms = stack_codes(c, codes)
    for w, (_n, _k, n_pad, k_pad) in gemm_shapes(c.hidden_size, c.intermediate_size).items():
        data, form = getattr(c, w), forms[f"{w}_weight"]
        _check_codes(f"{w}_weight", data, form)
        out[f"{w}_weight"] = repack_weights(pad_matrix(recode(data, form), n_pad, k_pad // 2, 0), f"{w}_weight")
        scale = pad_matrix(getattr(c, f"{w}_scale").to(torch.bfloat16), n_pad, k_pad // GROUP_SIZE, 0)
        out[f"{w}_weight_scale"] = lay_out_scales(scale)
    return out


def from_kernel(k: KernelTensors, sizes: LayoutSizes, codes: str | Mapping[str, str]) -> CanonicalExperts:
    """Exact inverse of :func:`to_kernel` with the forms the stacks were written in (a mapping by
    weight tensor, or one form for both; "auto" cannot be inverted: the bytes do not say which form
    humming chose, the manifest does); LayoutError for a padding element other than zero (tensor
    and index named). The caller checks the tensor set, shapes and dtypes."""
    if codes == AUTO:
        raise LayoutError("humming INT4: int4_codes=auto without the recorded choice of each stack "
                          "(the manifest's layout.stack_choices) cannot be inverted")
    forms = codes if not isinstance(codes, str) else dict.fromkeys(WEIGHTS, codes)
    parts: dict[str, Any] = {}
    for w, (n, kk, _n_pad, _k_pad) in gemm_shapes(sizes.hidden_size, sizes.intermediate_size).items():
        weight = unrepack_weights(k[f"{w}_weight"], f"{w}_weight")
        check_fill(f"{w}_weight", weight[:, n:], 0, (0, n, 0))
        check_fill(f"{w}_weight", weight[:, :n, kk // 2:], 0, (0, 0, kk // 2))
        parts[w] = recode(weight[:, :n, : kk // 2], forms[f"{w}_weight"], inverse=True)
        scale = unlay_scales(k[f"{w}_weight_scale"])
        check_fill(f"{w}_weight_scale", scale[:, n:], 0, (0, n, 0))
        check_fill(f"{w}_weight_scale", scale[:, :n, kk // GROUP_SIZE:], 0, (0, 0, kk // GROUP_SIZE))
        parts[f"{w}_scale"] = scale[:, :n, : kk // GROUP_SIZE].contiguous()
    return CanonicalExperts(row_order=ROW_ORDER, weight_format=WEIGHT_FORMAT, **parts)


def nibble_type(codes: str) -> str:
    """humming's weight type of the ``int4_codes`` value ``codes`` (auto: each stack's own)."""
    return B_DTYPES.get(codes, "uint4 or float4e0m3 (per stack: layout.stack_choices)")


def layer_config_fields(codes: str) -> dict[str, Any]:
    """The ``LayerConfig`` fields that differ from the MXFP4 ones (humming's ``prepare_layer_config``
    for the compressed-tensors int schema after ``convert_symmetric_integer_weight``); ``b_dtype``
    None for "auto" (each stack's is in the manifest's ``layout.stack_choices``)."""
    return {"b_dtype": B_DTYPES.get(codes), "bs_dtype": "bfloat16", "weight_scale_group_size": GROUP_SIZE}


class HummingInt4:
    """The INT4 part of the humming layout's INT4 form (module docstring; :class:`mxconv.layouts.humming.HummingForm`
    composes it): this module's functions behind the interface ``humming_mx.HummingMX`` has; ``codes`` is the ``int4_codes``
    option's value (a form, "auto", or the recorded form per weight tensor)."""

    weight_format = WEIGHT_FORMAT
    intermediate_align = 1  # vLLM pads nothing for INT4
    manifest_head = {"variant": "int4"}
    manifest_oracle = {"vllm_oracle": "WNA16MoEBackend"}
    bias_refusal = BIAS_REFUSAL

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str) -> tuple[int, int]:
        return padded_sizes(hidden_size, intermediate_size, row_order)

    def kernel_specs(self, sizes: LayoutSizes) -> dict[str, TensorSpec]:
        return kernel_specs(sizes)

    def stack_choices(self, c: CanonicalExperts, codes: str | Mapping[str, str]) -> dict[str, str]:
        """The code form of each GEMM's stack (:func:`stack_codes`), recorded in the manifest."""
        return stack_codes(c, codes)

    def to_kernel(self, c: CanonicalExperts, codes: str | Mapping[str, str], kernel_choice: KernelChoice) -> KernelTensors:
        """torch ops on every device (``kernel_choice``: no Triton kernel for INT4 words)."""
        return to_kernel(c, codes)

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, codes: str | Mapping[str, str]) -> CanonicalExperts:
        return from_kernel(k, sizes, codes)

    def storage_fields(self, codes: Any) -> dict[str, Any]:
        """The manifest's fields on the code form, the stored words and the scales."""
        return {"int4_codes": codes,
                "weight_dtype": f"int32 words of eight {nibble_type(codes)} nibbles (humming weight_repack_nk, "
                                "interleave_mode 3)",
                "scale_dtype": "bfloat16", "group_size": GROUP_SIZE, "scale_fill": 0.0}  # fmt: skip

    def layer_config_fields(self, weight: str, codes: str | Mapping[str, str]) -> dict[str, Any]:
        """:func:`layer_config_fields` of GEMM ``weight``'s form (``codes`` one form, or one per weight tensor)."""
        return layer_config_fields(codes if isinstance(codes, str) else codes[f"{weight}_weight"])


INT4 = HummingInt4()
