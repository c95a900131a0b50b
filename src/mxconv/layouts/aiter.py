"""AMD AITER MXFP4 MoE layouts: the bytes vLLM (>= 0.33, ROCm, gfx950) hands to AITER's CK kernels.

Spec: docs/layout-aiter.md. Two kernel families, picked by ``--activation``:

* ``"bf16"``  -> a16w4, vLLM backend ``AITER_MXFP4_BF16`` (spec sections 4.2 / 4.3 default path).
  w13 rows are put in concat order (gpt-oss interleaved sources are de-interleaved first), then
  weights get ``W16 o GU16`` (w13) / ``W16`` (w2); scales get their K columns padded to a multiple
  of 8 with 0x7F, then ``GU16`` (w13 only) and ``S32x8``, stored **2-D** ``[E*N, Cp]``.
* ``"mxfp4"`` -> a4w4, vLLM backend ``AITER_MXFP4_MXFP4`` (section 4.4). Rows keep their source
  order; weights ``W16``; scales ``e8m0_shuffle`` of the 2-D ``[E*N, K/32]`` view, stored **3-D**
  ``[E, N, round_up(K/32, 8)]``. The padded scale columns are uninitialised upstream; we write 0x7F.

Padding (section 4.1, vLLM 0.33 ROCm table), all zero-filled (weights, scales, biases):

| activation | row order                  | hidden align | intermediate align |
|------------|----------------------------|--------------|--------------------|
| bf16       | interleaved (gpt-oss)      | 256          | 256                |
| bf16       | halves (silu checkpoints)  | 128          | 128                |
| mxfp4      | either                     | 256          | 128                |

Every transform is a reshape/permute of whole bytes, so it runs unchanged on CPU and CUDA tensors
and over the whole ``[E, ...]`` stack at once. The primitives accept any dtype (tests feed them
integer id tensors to trace where each byte goes). ``to_kernel`` folds padding, de-interleave and
GU16 into one row table per tensor; on CUDA the Triton kernels of ``mxconv.kernels.trtllm_aiter``
apply it together with W16 / S32x8 in one pass.

Options: :class:`AiterOptions`. MXFP8 experts (vLLM ``AITER_MXFP8``): :mod:`mxconv.layouts.aiter_mxfp8`, the
second :class:`~mxconv.layouts.forms.WeightForm` the layout declares beside :class:`AiterMxfp4`.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice, KernelLocations
from mxconv.experts.padding import unpad_canonical
from mxconv.experts.stack import ROW_ORDERS, CanonicalExperts, LayoutSizes, round_up
from mxconv.experts.tensors import KERNEL_TENSOR_NAMES, KernelTensors, TensorSpec, bias_specs, in_kernel_order
from mxconv.layouts import aiter_mxfp8
from mxconv.layouts.aiter_bytemap import (
    ACTIVATIONS, SCALE_PAD_FILL, check_a4w4_rows, check_activation, need, w16_bytes, deinterleave_rows,
    deinterleave_source_rows, gu16_inverse, gu16_source_rows,
    interleave_rows, shuffle_scale_a4w4,
    shuffle_scale_a16w4, unshuffle_scale_a4w4, unshuffle_scale_a16w4, w16_inverse,
)
from mxconv.layouts.base import LayoutOption, LayoutOptions
from mxconv.layouts.forms import FormBase, FormsLayout
from mxconv.layouts.gathers import cached_index, gather_padded_rows, layout_kernels, pad_row_source
from mxconv.source.st_format import torch_dtype
from mxconv.source.manifest import Manifest

if TYPE_CHECKING:
    import torch

__all__ = ["KERNEL_KINDS", "LAYOUT", "VLLM_BACKENDS", "VLLM_PAD_FILL", "AiterLayout", "AiterMxfp4", "AiterOptions"]

BACKEND_NAME = "aiter"
LAYOUT_VERSION = 1

# Fill of the padding vLLM allocates before any shuffle (gpt-oss Mxfp4MoEMethod zero-inits).
VLLM_PAD_FILL = 0
VLLM_BACKENDS = {"bf16": "AITER_MXFP4_BF16", "mxfp4": "AITER_MXFP4_MXFP4"}
KERNEL_KINDS = {"bf16": "a16w4", "mxfp4": "a4w4"}

# (hidden align, intermediate align) per (activation, row order): spec section 4.1.
_ALIGN: dict[tuple[str, str], tuple[int, int]] = {
    ("bf16", "interleaved"): (256, 256),
    ("bf16", "halves"): (128, 128),
    ("mxfp4", "interleaved"): (256, 128),
    ("mxfp4", "halves"): (256, 128),
}

# Alternative dtypes with identical bytes that from_kernel accepts (vLLM's own views), by safetensors name.
_BYTE_ALIASES: dict[str, tuple[str, ...]] = {"weight": ("F4",), "scale": ("F8_E8M0",)}


def _row_table(
    rows: int, padded_rows: int, row_order: str | None, deinterleave: bool, gate_up: bool, device: torch.device
) -> torch.Tensor:
    """Unpadded source row behind each row of the shuffled tensor (-1 = vLLM zero padding), cached
    on ``device``: padding (``row_order`` as in :func:`pad_row_source`), then the a16w4 de-interleave
    of gpt-oss rows, then GU16 - every row map of :func:`permute_padded` in one table."""

    def build() -> torch.Tensor:
        tab = pad_row_source(rows, padded_rows, row_order)
        if deinterleave:
            tab = tab[deinterleave_source_rows(padded_rows)]
        if gate_up:
            tab = tab[gu16_source_rows(padded_rows)]
        return tab

    return cached_index(("aiter", rows, padded_rows, row_order, deinterleave, gate_up), device, build)


def _to_kernel_gathered(c: CanonicalExperts, hp: int, ip: int, activation: str, kernel_choice: KernelChoice) -> KernelTensors:
    """:func:`permute_padded` of ``pad_canonical(c, hp, ip)``, with padding and row maps fused into
    one row gather per tensor (Triton kernels on CUDA unless ``kernel_choice`` is TORCH, torch elsewhere)."""
    import torch

    e, h, i = c.num_experts, c.hidden_size, c.intermediate_size
    a16w4 = activation == "bf16"
    deint = a16w4 and c.row_order == "interleaved"
    t13 = _row_table(2 * i, 2 * ip, c.row_order, deint, a16w4, c.device)
    t2 = _row_table(h, hp, None, False, False, c.device)
    c13, c2 = round_up(hp // 32, 8), round_up(ip // 32, 8)
    lt = layout_kernels(c.w13, kernel_choice)
    out: KernelTensors = {}
    if lt is not None:
        out["w13_weight"] = lt.w16_tiles(c.w13, t13, hp // 2)
        s13 = lt.s32x8_tiles(c.w13_scale, t13, hp // 32, c13, SCALE_PAD_FILL)
        out["w2_weight"] = lt.w16_tiles(c.w2, t2, ip // 2)
        s2 = lt.s32x8_tiles(c.w2_scale, t2, ip // 32, c2, SCALE_PAD_FILL)
    else:
        out["w13_weight"] = w16_bytes(gather_padded_rows(c.w13, t13, hp // 2, VLLM_PAD_FILL))
        out["w2_weight"] = w16_bytes(gather_padded_rows(c.w2, t2, ip // 2, VLLM_PAD_FILL))
        g13 = gather_padded_rows(c.w13_scale, t13, hp // 32, VLLM_PAD_FILL)
        g2 = gather_padded_rows(c.w2_scale, t2, ip // 32, VLLM_PAD_FILL)
        if a16w4:  # GU16 is already in the row table
            s13, s2 = shuffle_scale_a16w4(g13, gate_up=False), shuffle_scale_a16w4(g2, gate_up=False)
        else:
            s13, s2 = shuffle_scale_a4w4(g13), shuffle_scale_a4w4(g2)
    if a16w4:
        out["w13_weight_scale"], out["w2_weight_scale"] = s13.reshape(e * 2 * ip, c13), s2.reshape(e * hp, c2)
    else:
        out["w13_weight_scale"], out["w2_weight_scale"] = s13.reshape(e, 2 * ip, c13), s2.reshape(e, hp, c2)
    if c.w13_bias is not None:
        b13 = _row_table(2 * i, 2 * ip, c.row_order, deint, False, c.device)
        out["w13_bias"] = gather_padded_rows(c.w13_bias.to(torch.float32), b13)
    if c.w2_bias is not None:
        out["w2_bias"] = gather_padded_rows(c.w2_bias.to(torch.float32), t2)
    return in_kernel_order(out)


# ---------------------------------------------------------------------------------------------
# The Layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AiterOptions(LayoutOptions):
    """The aiter layout's resolved options. ``check_undefined_scale_padding`` (default True): in
    :meth:`AiterLayout.from_kernel` for ``mxfp4``, require the scale column padding (bytes upstream
    leaves uninitialised) to hold 0x7F; False reads scales dumped from a live vLLM process. The
    a16w4 scale padding is defined upstream (0x7F) and is always checked."""

    check_undefined_scale_padding: bool = True


class AiterMxfp4(FormBase):
    """The MXFP4 form (module docstring): a16w4 (bf16 activations) or a4w4 (mxfp4)."""

    weight_format = "mxfp4"
    activations = ACTIVATIONS
    vllm_backends = {act: (name,) for act, name in VLLM_BACKENDS.items()}

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: AiterOptions) -> tuple[int, int]:  # fmt: skip
        """(Hp, Ip) per vLLM 0.33's ROCm table (module docstring). LayoutError if impossible."""
        check_activation(activation)
        _check_row_order(row_order)
        for what, size in (("hidden", hidden_size), ("intermediate", intermediate_size)):
            if size <= 0 or size % 32:
                raise LayoutError(
                    f"aiter: {what} size {size} must be a positive multiple of 32 (MXFP4 block size)"
                )
        h_align, i_align = _ALIGN[(activation, row_order)]
        return round_up(hidden_size, h_align), round_up(intermediate_size, i_align)

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: AiterOptions) -> dict[str, TensorSpec]:
        """Output shapes/dtypes. a16w4: scales 2-D ``[E*N, round_up(K/32, 8)]``; a4w4: 3-D
        ``[E, N, round_up(K/32, 8)]``; weights ``[E, N, K/2]`` uint8; biases float32."""
        _check_sizes(sizes, activation)
        e, hp, ip = sizes.num_experts, sizes.padded_hidden_size, sizes.padded_intermediate_size
        u8 = "U8"
        c13, c2 = round_up(hp // 32, 8), round_up(ip // 32, 8)
        if activation == "bf16":
            s13, s2 = (e * 2 * ip, c13), (e * hp, c2)
        else:
            s13, s2 = (e, 2 * ip, c13), (e, hp, c2)
        return in_kernel_order({
            "w13_weight": TensorSpec((e, 2 * ip, hp // 2), u8),
            "w13_weight_scale": TensorSpec(s13, u8),
            "w2_weight": TensorSpec((e, hp, ip // 2), u8),
            "w2_weight_scale": TensorSpec(s2, u8),
            **bias_specs(sizes, hp, ip, "F32"),
        })

    def to_kernel(self, c: CanonicalExperts, activation: str, options: AiterOptions,
                  kernel_choice: KernelChoice) -> KernelTensors:  # fmt: skip
        """Canonical (unpadded) stack -> AITER kernel tensors on ``c``'s device (padding included);
        ``kernel_choice`` picks the Triton layout kernels or torch ops (same bytes)."""
        c.validate()  # includes: both biases or neither
        hp, ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation, options)
        sizes = c.sizes(hp, ip)
        _check_sizes(sizes, activation)
        return _to_kernel_gathered(c, hp, ip, activation, kernel_choice)

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: AiterOptions) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel`. Checks shapes/dtypes, the 0x7F scale column padding
        and vLLM's zero padding (LayoutError naming the tensor and the first offending index).
        Biases come back as float32."""
        specs = self.kernel_specs(sizes, activation, options)
        t = _validated_inputs(k, specs)
        e, h, i = sizes.num_experts, sizes.hidden_size, sizes.intermediate_size
        hp, ip = sizes.padded_hidden_size, sizes.padded_intermediate_size
        interleaved = sizes.row_order == "interleaved"
        b13, b2 = t.get("w13_bias"), t.get("w2_bias")

        if activation == "bf16":
            w13 = gu16_inverse(w16_inverse(t["w13_weight"]))
            s13 = unshuffle_scale_a16w4(t["w13_weight_scale"], e, gate_up=True)
            w2 = w16_inverse(t["w2_weight"])
            s2 = unshuffle_scale_a16w4(t["w2_weight_scale"], e, gate_up=False)
            check_pad = True
            fwd13 = _a16w4_scale_forward(gate_up=True, interleaved=interleaved)
            fwd2 = _a16w4_scale_forward(gate_up=False, interleaved=False)
            if interleaved:
                w13, s13 = interleave_rows(w13), interleave_rows(s13)
                b13 = None if b13 is None else interleave_rows(b13)
        else:
            w13 = w16_inverse(t["w13_weight"])
            s13 = unshuffle_scale_a4w4(t["w13_weight_scale"])
            w2 = w16_inverse(t["w2_weight"])
            s2 = unshuffle_scale_a4w4(t["w2_weight_scale"])
            check_pad = options.check_undefined_scale_padding
            fwd13 = fwd2 = shuffle_scale_a4w4

        if check_pad:
            _check_scale_column_padding("w13_weight_scale", s13, hp // 32, fwd13)
            _check_scale_column_padding("w2_weight_scale", s2, ip // 32, fwd2)
        padded = CanonicalExperts(
            w13=w13,
            w13_scale=s13[..., : hp // 32],
            w2=w2,
            w2_scale=s2[..., : ip // 32],
            w13_bias=b13,
            w2_bias=b2,
            row_order=sizes.row_order,
        )
        try:
            return unpad_canonical(padded, h, i, scale_fill=VLLM_PAD_FILL, check=True)
        except LayoutError as err:
            raise LayoutError(
                f"aiter ({KERNEL_KINDS[activation]}): {err} (index in the unshuffled, padded "
                f"[E, N, K] view with {sizes.row_order} w13 rows)"
            ) from err

    def describe(self, sizes: LayoutSizes, activation: str, options: AiterOptions) -> dict[str, Any]:
        """Manifest ``layout`` fields owned by this backend (kernel_params are added by the caller)."""
        _check_sizes(sizes, activation)
        hp, ip = sizes.padded_hidden_size, sizes.padded_intermediate_size
        a16w4 = activation == "bf16"
        scale_cols_padded = (hp // 32) % 8 != 0 or (ip // 32) % 8 != 0
        # shuffle_scale_a16w4 learnt to pad K/32 to 8 columns in AITER c2b69b9b87; before that the
        # same bytes came out of c4be416761 whenever no column padding is needed.
        aiter_min = "c2b69b9b87" if (a16w4 and scale_cols_padded) else "c4be416761"
        h_align, i_align = _ALIGN[(activation, sizes.row_order)]
        weight_view = "float4_e2m1fn_x2"
        return {
            "name": BACKEND_NAME,
            "version": LAYOUT_VERSION,
            "engine_compat": {"vllm": ">=0.33", "aiter": f">={aiter_min}", "gfx": "gfx950"},
            "activation": activation,
            "vllm_backend": VLLM_BACKENDS[activation],
            "kernel": KERNEL_KINDS[activation],
            "is_shuffled": True,
            "padding": {"hidden_align": h_align, "intermediate_align": i_align, "fill": VLLM_PAD_FILL},
            "weight_shuffle": "W16 o GU16 (w13), W16 (w2)" if a16w4 else "W16 (w13, w2)",
            "weight_tile": [16, 16],
            "w13_kernel_row_order": "gate_up_16row_blocks" if a16w4 else sizes.row_order,
            "scale_shuffle": "shuffle_scale_a16w4" if a16w4 else "e8m0_shuffle",
            "scale_tile": [32, 8],
            "scale_layout": "2d [E*N, round_up(K/32,8)]" if a16w4 else "3d [E, N, round_up(K/32,8)]",
            "scale_pad_fill": SCALE_PAD_FILL,
            "scale_pad_defined_upstream": a16w4 or not scale_cols_padded,
            "w13_bias_row_order": "halves" if a16w4 else sizes.row_order,
            "torch_dtype": {"w13_weight": weight_view, "w2_weight": weight_view, "w13_weight_scale": "uint8",
                            "w2_weight_scale": "uint8", "w13_bias": "float32", "w2_bias": "float32"},
            "stored_dtype": {"weights": "uint8", "scales": "uint8", "biases": "float32"},
        }


MXFP4 = AiterMxfp4()


class AiterLayout(FormsLayout):
    """AITER MoE layouts: MXFP4 (vLLM ROCm ``AITER_MXFP4_BF16`` / ``AITER_MXFP4_MXFP4``, :class:`AiterMxfp4`)
    and MXFP8 experts (``Fp8MoeBackend.AITER_MXFP8``, :mod:`mxconv.layouts.aiter_mxfp8`)."""

    name = BACKEND_NAME
    version = LAYOUT_VERSION
    weight_forms = {"mxfp4": MXFP4, "mxfp8": aiter_mxfp8.MXFP8}
    options_type = AiterOptions
    options = (LayoutOption("check_undefined_scale_padding", bool, True, "verify: require 0x7F in the scale padding "
                            "upstream leaves uninitialised (a4w4; MXFP8 w2) (false for scales dumped from a live vLLM)"),)

    def kernel_unavailable(self, manifest: Manifest, device: Any = "cuda",
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        """AITER's CK MoE kernels run on ROCm only."""
        return "AITER kernels need a ROCm gfx950 GPU and the aiter package"


LAYOUT = AiterLayout()


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def _check_row_order(row_order: str) -> None:
    if row_order not in ROW_ORDERS:
        raise LayoutError(f"aiter: unknown w13 row order {row_order!r} (expected one of {ROW_ORDERS})")


def _check_sizes(sizes: LayoutSizes, activation: str) -> None:
    """Raise LayoutError unless the padded sizes satisfy the shuffle rules of ``activation``."""
    check_activation(activation)
    _check_row_order(sizes.row_order)
    e, h, i = sizes.num_experts, sizes.hidden_size, sizes.intermediate_size
    hp, ip = sizes.padded_hidden_size, sizes.padded_intermediate_size
    need(e >= 1, f"need at least one expert, got {e}")
    need(h % 32 == 0 and i % 32 == 0, f"hidden ({h}) and intermediate ({i}) sizes must be multiples of 32")
    need(hp >= h and ip >= i, f"padded sizes ({hp}, {ip}) smaller than ({h}, {i})")
    need(hp % 32 == 0 and ip % 32 == 0, f"padded sizes ({hp}, {ip}) must be multiples of 32")
    if activation == "bf16":
        # shuffle_weight_a16w4 reshapes K into 64-byte groups: K % 128 for both GEMMs.
        need(hp % 128 == 0, f"a16w4 needs the padded hidden size % 128 == 0 (w13 K), got {hp}")
        need(ip % 128 == 0, f"a16w4 needs the padded intermediate size % 128 == 0 (w2 K), got {ip}")
    else:
        # shuffle_weight (16, 16) asserts bytes % 32, i.e. K % 64.
        need(hp % 64 == 0, f"a4w4 needs the padded hidden size % 64 == 0 (w13 K), got {hp}")
        need(ip % 64 == 0, f"a4w4 needs the padded intermediate size % 64 == 0 (w2 K), got {ip}")
        check_a4w4_rows("w13_weight_scale", e, 2 * ip)
        check_a4w4_rows("w2_weight_scale", e, hp)


def _validated_inputs(k: KernelTensors, specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """Check every expected kernel tensor is present with the planned shape/dtype; return uint8 views."""
    import torch

    extra = sorted(set(k) & set(KERNEL_TENSOR_NAMES) - set(specs))
    if extra:
        raise LayoutError(f"aiter: unexpected kernel tensor(s) {extra} for a layout without biases")
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if name not in k:
            raise LayoutError(f"aiter: kernel tensor {name} is missing")
        t = k[name]
        if tuple(t.shape) != spec.shape:
            raise LayoutError(f"aiter: {name} has shape {tuple(t.shape)}, expected {spec.shape}")
        aliases = [torch_dtype(a) for a in _BYTE_ALIASES["scale" if name.endswith("_scale") else "weight"]]
        if spec.dtype == torch.uint8 and t.dtype in aliases:
            t = t.view(torch.uint8)
        if t.dtype != spec.dtype:
            raise LayoutError(f"aiter: {name} has dtype {t.dtype}, expected {spec.dtype}")
        out[name] = t
    return out


def _a16w4_scale_forward(gate_up: bool, interleaved: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Map from the unshuffled ``[E, N, Cp]`` scale view (source row order) to the stored 2-D tensor."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return shuffle_scale_a16w4(deinterleave_rows(x) if interleaved else x, gate_up)

    return forward


def _check_scale_column_padding(
    name: str, logical: torch.Tensor, cols: int, forward: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Raise LayoutError if columns ``>= cols`` of the unshuffled ``[E, N, Cp]`` scales are not 0x7F.

    ``forward`` maps the unshuffled view to the stored tensor; it locates the offending byte there.
    """
    import torch

    pad = logical[..., cols:]
    if pad.numel() == 0:
        return
    bad = pad != SCALE_PAD_FILL
    if not bool(bad.any()):
        return
    e, n, q = (int(v) for v in bad.nonzero()[0].tolist())
    marker = torch.zeros(logical.shape, dtype=torch.uint8, device=logical.device)
    marker[e, n, cols + q] = 1
    stored = [int(v) for v in forward(marker).nonzero()[0].tolist()]
    raise LayoutError(
        f"aiter: scale column padding of {name} at stored index {stored} (expert {e}, row {n}, "
        f"scale column {cols + q}) holds {int(pad[e, n, q])}, expected {SCALE_PAD_FILL} (0x7F)"
    )
