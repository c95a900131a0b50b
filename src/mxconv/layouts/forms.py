"""Layouts that hold experts in more than one weight format: the :class:`WeightForm` contract and the
:class:`FormsLayout` base that picks a form once per call.

Where the bytes differ by the experts' weight format (marlin MXFP4 / MXFP8, trtllm MXFP4 / MxInt4 /
MXFP8, humming MXFP4 / MXFP8 / INT4, aiter and deepgemm MXFP4 / MXFP8), each format is one small object,
a :class:`WeightForm`, and the layout declares them and nothing else about dispatch:

    class MyLayout(FormsLayout):
        name, version = "mine", 1
        weight_forms = {"mxfp4": MXFP4, "mxfp8": MXFP8}     # canonical weight format -> its form

:class:`FormsLayout` looks the form up (LayoutError "mine takes mxfp4, mxfp8 experts, got int4") from
the stack's or the sizes' ``weight_format`` and hands it every step with the resolved options; it
derives ``weight_formats``, ``activations`` (the forms', first form first) and the served vLLM backends
(``vllm_backends`` from the MXFP4 form, ``vllm_int4_backends`` from the INT4 one, ``vllm_mxfp8_backends``
from the MXFP8 one) from the declaration, so none is listed twice. Forms share a backend's byte maps by
composition (``<name>_bytemap.py``), never by inheriting from the layout.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.experts.tensors import KernelTensors, TensorSpec
from mxconv.layouts.activation_quant import DYNAMIC_MXFP8, ActivationQuant, declared_or_named
from mxconv.layouts.base import LayoutBase, LayoutOptions
from mxconv.layouts.checks import (
    check_block_sizes,
    check_mxfp8_method_sizes,
    mxfp8_method_bias_refusal,
)

__all__ = ["FormBase", "FormsLayout", "Mxfp8MethodForm", "WeightForm"]



class WeightForm(Protocol):
    """One weight format of a layout: its sizes, bytes and manifest fields. ``options`` is always the
    layout's resolved options object (its ``options_type``); a form reads the fields it needs."""

    weight_format: str  # the canonical format it takes (CanonicalExperts.weight_format)
    activations: tuple[str, ...]  # the activations it takes, in the layout's order
    # activation -> vLLM backends that hold these bytes under the vLLM method of this format (MXFP4:
    # Mxfp4MoeBackend, INT4: WNA16MoEBackend, MXFP8: Fp8MoeBackend names); empty: none does
    vllm_backends: Mapping[str, tuple[str, ...]]
    # activation -> how vLLM quantizes the hidden states these experts get, where the activation's name does
    # not say it (mxconv.layouts.activation_quant; FormBase: {}, the name says it)
    activation_quant: Mapping[str, ActivationQuant]
    kernel_label: str  # how kernel_unavailable names the engine's kernels for this form (FormBase: upper case)
    # why this form's bytes hold no expert biases (the LayoutError its kernel_specs raise for sizes with
    # them); None: they hold them (FormBase)
    bias_refusal: str | None
    # why this form's kernel tensors mix experts (a layer is laid out whole, never by expert groups); None:
    # every tensor is a stack over experts along dim 0 (FormBase)
    whole_layers: str | None

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: Any) -> tuple[int, int]:  # fmt: skip
        """(Hp, Ip) for one rank's sizes; LayoutError if this form cannot lay them out."""
        ...

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the kernel tensors for ``sizes``."""
        ...

    def to_kernel(self, c: CanonicalExperts, activation: str, options: Any, kernel_choice: KernelChoice) -> KernelTensors:
        """Canonical stack -> kernel tensors on ``c``'s device."""
        ...

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: Any) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel`, padding checked (LayoutError naming tensor and index)."""
        ...

    def describe(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, Any]:
        """The manifest's ``layout`` fields for this form."""
        ...

    def stack_choices(self, c: CanonicalExperts, options: Any) -> dict[str, str]:
        """What :meth:`to_kernel` chooses from ``c``'s data, by kernel tensor name (FormBase: nothing)."""
        ...


class FormBase:
    """Defaults of a :class:`WeightForm`'s optional members (subclass it, or declare them)."""

    weight_format: str = ""
    activations: tuple[str, ...] = ()
    vllm_backends: Mapping[str, tuple[str, ...]] = {}
    bias_refusal: str | None = None
    whole_layers: str | None = None
    activation_quant: Mapping[str, ActivationQuant] = {}

    @property
    def kernel_label(self) -> str:
        return self.weight_format.upper()

    def stack_choices(self, c: CanonicalExperts, options: Any) -> dict[str, str]:
        return {}


# How every MXFP8 form's manifest says whose experts it holds: vLLM 0.33 serves MXFP8 experts under the
# FP8 MoE oracle (fused_moe/oracle/mxfp8.py picks an Fp8MoeBackend), whichever backend lays them out.
MXFP8_ORACLE: dict[str, str] = {"variant": "mxfp8", "vllm_oracle": "Fp8MoeBackend"}
# The manifest's ``padding`` of an Mxfp8MethodForm: the method allocates the checkpoint's sizes, padded by nothing.
MXFP8_METHOD_PADDING: dict[str, int] = {"hidden_align": 1, "intermediate_align": 1, "fill": 0}


class Mxfp8MethodForm(FormBase):
    """An MXFP8 form whose tensors are the ones vLLM's MXFP8 method (CompressedTensorsW8A8Mxfp8MoEMethod)
    allocates: one activation, one Fp8MoeBackend, (H, I) multiples of 32 and nothing padded, no expert
    biases. A subclass declares ``label`` (how its errors start, "aiter MXFP8"), ``activation``,
    ``vllm_backend`` and ``activation_rule`` (why another activation is refused, formatted with
    ``activation``), and overrides :meth:`check_sizes` where its engine limits (H, I) further. The method's
    quant config quantizes the experts' inputs to MXFP8 (``kMxfp8Dynamic``), whoever does it (aiter inside
    fused_moe, vLLM before DeepGemmExperts, the XPU kernel from the bf16 hidden states it is handed): that is
    the form's ``activation_quant`` unless a subclass declares its own."""

    weight_format = "mxfp8"
    label: str = ""
    activation: str = ""
    vllm_backend: str = ""
    activation_rule: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.activations = (cls.activation,)
        cls.vllm_backends = {cls.activation: (cls.vllm_backend,)}  # Fp8MoeBackend
        if "bias_refusal" not in cls.__dict__:  # a subclass's own declaration stands
            cls.bias_refusal = mxfp8_method_bias_refusal(cls.label)
        if "activation_quant" not in cls.__dict__:
            cls.activation_quant = {cls.activation: DYNAMIC_MXFP8}

    def check_sizes(self, hidden_size: int, intermediate_size: int) -> None:
        """LayoutError where the engine cannot take one rank's (H, I) (the default takes every one)."""

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: Any) -> tuple[int, int]:  # fmt: skip
        """(H, I): vLLM's MXFP8 methods pad nothing; LayoutError for another activation, sizes that are not
        multiples of 32 or that :meth:`check_sizes` refuses."""
        if activation != self.activation:
            raise LayoutError(f"{self.label}: " + self.activation_rule.format(activation=activation))
        check_block_sizes(self.label, hidden_size, intermediate_size, row_order, 32)
        self.check_sizes(hidden_size, intermediate_size)
        return hidden_size, intermediate_size

    def method_sizes(self, sizes: LayoutSizes, activation: str, options: Any) -> tuple[int, int]:
        """(H, I) of ``sizes``, checked as :meth:`padded_sizes` does and as the method allocates them
        (the padded sizes equal to them, no expert biases)."""
        want = self.padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order, activation, options)
        return check_mxfp8_method_sizes(self.label, sizes, want)


class FormsLayout(LayoutBase):
    """A layout declared by its :class:`WeightForm`\\ s (module docstring): ``weight_forms`` maps each
    canonical weight format to its form; every method asks the form of the weight format at hand."""

    weight_forms: Mapping[str, WeightForm] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forms = cls.weight_forms
        cls.weight_formats = tuple(forms)
        cls.activations = tuple(dict.fromkeys(a for form in forms.values() for a in form.activations))
        cls.vllm_backends = _served(forms, "mxfp4")  # Mxfp4MoeBackend names
        cls.vllm_int4_backends = _served(forms, "int4")  # WNA16MoEBackend names
        cls.vllm_mxfp8_backends = _served(forms, "mxfp8")  # Fp8MoeBackend names

    def default_activation(self, weight_format: str = "mxfp4") -> str:
        """The first activation the form of ``weight_format`` serves (trtllm's MXFP8 form: mxfp8)."""
        return self.form(weight_format).activations[0]

    def format_activations(self, weight_format: str) -> tuple[str, ...]:
        """The activations the form of ``weight_format`` serves (none for a format without a form)."""
        return tuple(self.weight_forms[weight_format].activations) if weight_format in self.weight_forms else ()

    def bias_refusal(self, weight_format: str) -> str | None:
        """The ``bias_refusal`` the form of ``weight_format`` declares (None for a format without a form)."""
        return self.weight_forms[weight_format].bias_refusal if weight_format in self.weight_forms else None

    def whole_layers(self, weight_format: str) -> str | None:
        """The ``whole_layers`` the form of ``weight_format`` declares (None for a format without a form)."""
        return self.weight_forms[weight_format].whole_layers if weight_format in self.weight_forms else None

    def activation_quantization(self, activation: str, *, weight_format: str = "mxfp4") -> ActivationQuant:
        """How vLLM quantizes the inputs of ``weight_format``'s experts laid out for ``activation`` (the
        form's ``activation_quant``, else the name's); LayoutError for a format this layout does not take."""
        return declared_or_named(self.form(weight_format).activation_quant, activation)

    def form(self, weight_format: str) -> WeightForm:
        """The form of ``weight_format``; LayoutError for a format this layout does not take."""
        try:
            return self.weight_forms[weight_format]
        except KeyError:
            why = self.weight_format_refusals.get(weight_format)
            raise LayoutError(f"{self.name} takes {', '.join(self.weight_forms)} experts, got {weight_format}"
                              + (f": {why}" if why else "")) from None

    def padded_sizes(
        self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
        options: LayoutOptions | None = None, *, weight_format: str = "mxfp4",
    ) -> tuple[int, int]:
        """(Hp, Ip) by the form of ``weight_format``."""
        form = self.form(weight_format)
        return form.padded_sizes(hidden_size, intermediate_size, row_order, activation, self.options_of(options))

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: LayoutOptions) -> dict[str, TensorSpec]:
        """The kernel tensors of ``sizes.weight_format``'s form."""
        return self.form(sizes.weight_format).kernel_specs(sizes, activation, self.options_of(options))

    def to_kernel(self, c: CanonicalExperts, activation: str, options: LayoutOptions,
                  kernel_choice: KernelChoice = KernelChoice.AUTO) -> KernelTensors:  # fmt: skip
        """``c`` laid out by the form of its weight format."""
        return self.form(c.weight_format).to_kernel(c, activation, self.options_of(options), kernel_choice)

    def from_kernel(
        self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: LayoutOptions
    ) -> CanonicalExperts:
        """The canonical stack back, by the form of ``sizes.weight_format``."""
        return self.form(sizes.weight_format).from_kernel(k, sizes, activation, self.options_of(options))

    def describe(self, sizes: LayoutSizes, activation: str, options: LayoutOptions) -> dict[str, Any]:
        """The manifest's ``layout`` fields, by the form of ``sizes.weight_format``."""
        return self.form(sizes.weight_format).describe(sizes, activation, self.options_of(options))

    def stack_choices(self, c: CanonicalExperts, options: LayoutOptions | None) -> dict[str, str]:
        """What the form of ``c``'s weight format chooses from its data (most choose nothing)."""
        return self.form(c.weight_format).stack_choices(c, self.options_of(options))


def _served(forms: Mapping[str, WeightForm], weight_format: str) -> dict[str, tuple[str, ...]]:
    """The vLLM backends per activation that hold the ``weight_format`` form's bytes (none: no such form)."""
    return dict(forms[weight_format].vllm_backends) if weight_format in forms else {}
