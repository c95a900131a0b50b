"""The padded-stack layouts: a backend whose stored tensors are the canonical expert stack, zero-padded
to (roundup(H, a), roundup(I, b)), with each tensor put through a byte map and its inverse.

cpu, deepgemm, cutlass and flashinfer-cutlass are such backends: they differ only by constants and
those maps. A backend module declares them on a :class:`PaddedStackLayout` subclass; they make its
MXFP4 :class:`~mxconv.layouts.forms.WeightForm`, a :class:`PaddedStack`, which does the rest, the same
way for every one of them (a layout with another format's form declares it in ``weight_forms``
beside: deepgemm's MXFP8):

    padded_sizes  (H, I) -> (roundup(H, hidden_align), roundup(I, intermediate_align)), after the
                  activation, the row order and the 32-element blocks are checked
    to_kernel     pad (:func:`~mxconv.experts.padding.pad_canonical`, every fill 0), reorder the
                  w13 rows (weights, scales, bias) if the form says so, map weights and scales
                  (:class:`Transform`), cast the biases
    from_kernel   the specs checked, every map inverted, the padding checked and cut off
    kernel_specs  weights [E, rows, cols] uint8, scales in the shape and dtype their map stores
    describe      the manifest fields every such layout writes, then the form's own ``notes``

What an activation stores is a :class:`StackForm` (the vLLM backend that holds it, the weight and
scale :class:`Transform`\\ s, the optional w13 :class:`RowMap`, its manifest notes): a backend with
one form per activation (flashinfer-cutlass: SM90 and SM100) declares several. Backends compose
these small objects; none subclasses another backend.

torch is imported lazily (the maps import it where they compute), so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.padding import pad_canonical, unpad_canonical
from mxconv.experts.stack import CanonicalExperts, LayoutSizes, round_up
from mxconv.experts.tensors import KernelTensors, TensorSpec, bias_specs, in_kernel_order
from mxconv.layouts.activation_quant import ActivationQuant
from mxconv.layouts.base import LayoutOptions, check_activation
from mxconv.layouts.checks import check_block_sizes, check_kernel_tensors, check_padded_sizes
from mxconv.layouts.forms import FormBase, FormsLayout
from mxconv.source.st_format import torch_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["AS_STORED", "PAD_FILL", "PaddedStack", "PaddedStackLayout", "RowMap", "StackForm", "Transform"]

MX_BLOCK = 32  # elements per E8M0 scale
PAD_FILL = 0  # every padding byte (the engines allocate their parameters with torch.zeros)
_DTYPE_WORDS = {"F32": "float32", "BF16": "bfloat16"}  # the manifest's bias_dtype


def _same_shape(rows: int, cols: int) -> tuple[int, ...]:
    return (rows, cols)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


@dataclass(frozen=True)
class Transform:
    """One stored tensor's byte map over a whole stack: ``forward`` turns the padded canonical
    [E, rows, cols] tensor into the stored one; ``inverse(stored, name, rows, cols)`` gives the
    canonical one back, LayoutError naming ``name`` for any fill of its own that is wrong.
    ``shape(rows, cols)`` is the stored shape per expert, ``dtype`` its safetensors dtype.
    :meth:`pair` makes one whose inverse needs only the stored tensor."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    inverse: Callable[[torch.Tensor, str, int, int], torch.Tensor]
    shape: Callable[[int, int], tuple[int, ...]] = _same_shape
    dtype: str = "U8"

    @classmethod
    def pair(
        cls, forward: Callable[[torch.Tensor], torch.Tensor], inverse: Callable[[torch.Tensor], torch.Tensor],
        shape: Callable[[int, int], tuple[int, ...]] = _same_shape, dtype: str = "U8",
    ) -> Transform:
        """A transform whose ``inverse`` reads everything it needs off the stored tensor."""
        return cls(forward, lambda stored, _name, _rows, _cols: inverse(stored), shape, dtype)


AS_STORED = Transform.pair(_contiguous, _contiguous)  # the canonical bytes as they are


@dataclass(frozen=True)
class RowMap:
    """An order of the padded w13 rows (weights, scales and bias alike): ``forward(t, row_order)``,
    its ``inverse``, and ``name``, the manifest's ``w13_kernel_row_order`` for it."""

    forward: Callable[[torch.Tensor, str], torch.Tensor]
    inverse: Callable[[torch.Tensor, str], torch.Tensor]
    name: str


@dataclass(frozen=True)
class StackForm:
    """What one activation stores: the vLLM backend (``Mxfp4MoeBackend`` name) that holds the bytes,
    the weight and scale maps, the w13 row order (None: the checkpoint's, as loaded), the manifest
    fields that describe it (``notes``, after the common ones) and how vLLM quantizes the experts' inputs
    where the activation's name does not say it (``activation_quant``; mxconv.layouts.activation_quant)."""

    vllm_backend: str
    weight: Transform = AS_STORED
    scale: Transform = AS_STORED
    w13_rows: RowMap | None = None
    notes: Mapping[str, Any] = field(default_factory=dict)
    activation_quant: ActivationQuant | None = None


class PaddedStack(FormBase):
    """The MXFP4 form of a padded-stack layout (module docstring): ``decl``, the :class:`PaddedStackLayout`
    subclass, declares the constants and :class:`StackForm`\\ s it reads."""

    weight_format = "mxfp4"

    def __init__(self, decl: type[PaddedStackLayout]) -> None:
        self.decl = decl
        self.activations = tuple(decl.forms)
        self.vllm_backends = {act: (form.vllm_backend,) for act, form in decl.forms.items()}
        self.activation_quant = {act: f.activation_quant for act, f in decl.forms.items() if f.activation_quant is not None}

    def aligns(self) -> tuple[int, int]:
        """(hidden, intermediate) multiples the per-rank sizes are padded to."""
        return self.decl.hidden_align, self.decl.intermediate_align

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: LayoutOptions) -> tuple[int, int]:  # fmt: skip
        """(Hp, Ip) for one rank; LayoutError unless H and I are positive multiples of 32 and the row
        order and activation are known."""
        check_activation(self.decl.name, activation, self.activations)
        check_block_sizes(self.decl.name, hidden_size, intermediate_size, row_order, MX_BLOCK)
        h_align, i_align = self.aligns()
        return round_up(hidden_size, h_align), round_up(intermediate_size, i_align)

    def _checked(self, sizes: LayoutSizes, activation: str, options: LayoutOptions) -> tuple[int, int]:
        """(Hp, Ip) of ``sizes``; LayoutError if its padded sizes are not this layout's."""
        want = self.padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order, activation, options)
        return check_padded_sizes(self.decl.name, sizes, want, self.decl.padding_rule)

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: LayoutOptions) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the stored tensors: weights as canonical, scales as their map stores them."""
        Hp, Ip = self._checked(sizes, activation, options)
        E, scale = sizes.num_experts, self.decl.forms[activation].scale
        return in_kernel_order({
            "w13_weight": TensorSpec((E, 2 * Ip, Hp // 2), "U8"),
            "w13_weight_scale": TensorSpec((E, *scale.shape(2 * Ip, Hp // MX_BLOCK)), scale.dtype),
            "w2_weight": TensorSpec((E, Hp, Ip // 2), "U8"),
            "w2_weight_scale": TensorSpec((E, *scale.shape(Hp, Ip // MX_BLOCK)), scale.dtype),
            **bias_specs(sizes, Hp, Ip, self.decl.bias_dtype),
        })

    def to_kernel(self, c: CanonicalExperts, activation: str, options: LayoutOptions,
                  kernel_choice: KernelChoice) -> KernelTensors:  # fmt: skip
        """Canonical stack -> stored kernel tensors on ``c``'s device (torch ops only: ``kernel_choice``
        has nothing to pick here)."""
        c.validate()
        Hp, Ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation, options)
        p = pad_canonical(c, Hp, Ip, scale_fill=PAD_FILL)
        form = self.decl.forms[activation]
        rows = (lambda t: form.w13_rows.forward(t, p.row_order)) if form.w13_rows else (lambda t: t)
        out: KernelTensors = {
            "w13_weight": form.weight.forward(rows(p.w13)), "w13_weight_scale": form.scale.forward(rows(p.w13_scale)),
            "w2_weight": form.weight.forward(p.w2), "w2_weight_scale": form.scale.forward(p.w2_scale),
        }
        bias = torch_dtype(self.decl.bias_dtype)
        if p.w13_bias is not None:
            out["w13_bias"] = rows(p.w13_bias.to(bias)).contiguous()
        if p.w2_bias is not None:
            out["w2_bias"] = p.w2_bias.to(bias).contiguous()
        return in_kernel_order(out)

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: LayoutOptions) -> CanonicalExperts:
        """Stored tensors -> canonical (unpadded) stack; biases come back in ``bias_dtype``.

        LayoutError for a missing/unexpected tensor, a wrong shape or dtype, tensors on different
        devices, or padding that is not zero (tensor and first index named, in the unmapped
        [E, rows, K/2 or K/32] view).
        """
        check_kernel_tensors(self.decl.name, k, self.kernel_specs(sizes, activation, options))
        form, order = self.decl.forms[activation], sizes.row_order
        Hp, Ip = sizes.padded_hidden_size, sizes.padded_intermediate_size
        rows = (lambda t: form.w13_rows.inverse(t, order)) if form.w13_rows else (lambda t: t)

        def unmapped(name: str, t: Transform, n: int, cols: int) -> torch.Tensor:
            return t.inverse(k[name], name, n, cols)

        padded = CanonicalExperts(
            w13=rows(unmapped("w13_weight", form.weight, 2 * Ip, Hp // 2)),
            w13_scale=rows(unmapped("w13_weight_scale", form.scale, 2 * Ip, Hp // MX_BLOCK)),
            w2=unmapped("w2_weight", form.weight, Hp, Ip // 2),
            w2_scale=unmapped("w2_weight_scale", form.scale, Hp, Ip // MX_BLOCK),
            w13_bias=rows(k["w13_bias"]) if sizes.has_bias else None,
            w2_bias=k["w2_bias"] if sizes.has_bias else None,
            row_order=order,
        )
        return unpad_canonical(padded, sizes.hidden_size, sizes.intermediate_size, scale_fill=PAD_FILL, check=True)

    def describe(self, sizes: LayoutSizes, activation: str, options: LayoutOptions) -> dict[str, Any]:
        """Manifest ``layout`` fields owned by this backend (kernel_params are added by the caller)."""
        self._checked(sizes, activation, options)
        d, form = self.decl, self.decl.forms[activation]
        h_align, i_align = self.aligns()
        return {
            "name": d.name,
            "version": d.version,
            "engine_compat": dict(d.engine_compat),
            "activation": activation,
            "vllm_moe_backend": form.vllm_backend,
            "padding": {"hidden_align": h_align, "intermediate_align": i_align, **d.padding_notes, "fill": PAD_FILL},
            "w13_kernel_row_order": form.w13_rows.name if form.w13_rows else sizes.row_order,
            **form.notes,
            "bias_dtype": _DTYPE_WORDS[d.bias_dtype],
        }


class PaddedStackLayout(FormsLayout):
    """A backend declared by constants and its :class:`StackForm`\\ s (module docstring).

    Declare ``name``, ``version``, ``forms`` (activation -> form; the first is the default
    activation), ``hidden_align`` / ``intermediate_align``, ``bias_dtype``, ``engine_compat``,
    ``padding_rule`` (words for a padding mismatch) and, where the maps pad more, ``padding_notes``.
    They make the layout's MXFP4 :class:`~mxconv.layouts.forms.WeightForm` (:class:`PaddedStack`);
    ``weight_forms`` declares any other format's form beside it (deepgemm: MXFP8). ``activations`` and
    the vLLM backends are derived from the forms.
    """

    forms: Mapping[str, StackForm] = {}
    hidden_align: int = 1
    intermediate_align: int = 1
    bias_dtype: str = "BF16"
    engine_compat: Mapping[str, str] = {}
    padding_rule: str = ""
    padding_notes: Mapping[str, Any] = {}  # extra manifest ``padding`` fields, before ``fill``

    def __init_subclass__(cls, **kwargs: Any) -> None:
        others = {fmt: form for fmt, form in cls.__dict__.get("weight_forms", {}).items() if fmt != "mxfp4"}
        cls.weight_forms = {"mxfp4": PaddedStack(cls), **others}
        super().__init_subclass__(**kwargs)
