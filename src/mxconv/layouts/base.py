"""What every backend layout is: the :class:`Layout` protocol, the :class:`LayoutBase` it subclasses
and its typed options (:class:`LayoutOption`).

A backend layout is a pair of pure functions over a whole expert stack:

    to_kernel(canonical, activation, options)   -> KernelTensors   (padding included)
    from_kernel(kernel, sizes, activation, options) -> CanonicalExperts (padding checked and removed)

Everything is torch tensor arithmetic (index gathers, views, reshapes), so the same code gives the same
bytes on CPU and on CUDA. No per-expert Python loops in the hot path.

The canonical stack, its sizes, padding and TP slicing live in :mod:`mxconv.experts`, the shared
gathers in :mod:`mxconv.layouts.gathers` and the shared checks in :mod:`mxconv.layouts.checks`; import
them from there (this module re-exports nothing).

torch is named in type annotations only (imported under TYPE_CHECKING), so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, make_dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.experts.tensors import KernelTensors, TensorSpec
from mxconv.layouts.activation_quant import ActivationQuant, declared_or_named
from mxconv.source.manifest import Manifest

if TYPE_CHECKING:
    import torch

    from mxconv.experts.kernel_settings import KernelLocations


__all__ = ["EmptyOptions", "Layout", "LayoutBase", "LayoutOption", "LayoutOptions", "check_activation"]


@dataclass(frozen=True)
class LayoutOption:
    """One typed, validated backend option (``mxconv repack --layout-option NAME=VALUE``).

    ``kind`` is ``int``, ``str`` or ``bool``; ``choices`` (optional) lists the accepted values;
    ``check`` (optional) returns an error text for a value of the right kind that is still wrong.
    """

    name: str
    kind: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    check: Callable[[Any], str | None] | None = None

    def parse(self, text: str) -> Any:
        """The value of ``text`` (as typed on the command line); LayoutError if it is not one."""
        value: Any = text
        if self.kind is bool:
            low = text.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise LayoutError(f"layout option {self.name}={text!r}: expected true or false")
            value = low in ("true", "1", "yes")
        elif self.kind is int:
            try:
                value = int(text, 10)
            except ValueError:
                raise LayoutError(f"layout option {self.name}={text!r}: expected a whole number") from None
        return self.validate(value)

    def validate(self, value: Any) -> Any:
        """``value`` if it is of this option's kind, among its choices and passes its check."""
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise LayoutError(f"layout option {self.name}={value!r}: expected a whole number")
        if self.kind is not int and not isinstance(value, self.kind):
            raise LayoutError(f"layout option {self.name}={value!r}: expected {self.kind.__name__}")
        if self.choices is not None and value not in self.choices:
            raise LayoutError(
                f"layout option {self.name}={value!r}: choose one of {', '.join(map(str, self.choices))}"
            )
        problem = self.check(value) if self.check else None
        if problem:
            raise LayoutError(f"layout option {self.name}={value!r}: {problem}")
        return value

    def describe(self) -> str:
        """One line for ``--help``: ``name=<choices|kind> (default X): help``."""
        values = "|".join(map(str, self.choices)) if self.choices else self.kind.__name__
        return f"{self.name}={values} (default {self.default}): {self.help}"


@dataclass(frozen=True)
class LayoutOptions:
    """A backend's options after :meth:`LayoutBase.resolve_options`: one frozen field per declared
    :class:`LayoutOption`, named as it and in its order. The layout methods read its attributes."""

    def to_json(self) -> dict[str, Any]:
        """The manifest's layout ``options``: every option by name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class EmptyOptions(LayoutOptions):
    """The options of a backend that declares none."""


def _options_type(cls: type) -> type[LayoutOptions]:
    """``cls.options_type`` checked against ``cls.options``; one made from them when not declared."""
    names = [o.name for o in cls.options]
    declared = cls.options_type
    if [f.name for f in fields(declared)] == names:
        return declared
    if "options_type" in cls.__dict__:
        raise TypeError(f"{cls.__name__}.options_type fields must be its options {names}, in that order")
    made = make_dataclass(f"{cls.__name__}Options", [(o.name, o.kind) for o in cls.options],
                          bases=(LayoutOptions,), frozen=True)  # fmt: skip
    made.__module__ = cls.__module__
    return made


def check_activation(backend: str, activation: str, activations: tuple[str, ...]) -> None:
    """LayoutError unless ``activation`` is one of ``activations`` (what ``backend``, or one of its forms, serves)."""
    if activation not in activations:
        raise LayoutError(f"{backend} does not support activation {activation!r}; supported: {', '.join(activations)}")


class LayoutBase:
    """Shared behaviour of every backend layout (subclass it and declare the class attributes).

    ``options`` declares the backend's typed options and ``options_type`` the frozen
    :class:`LayoutOptions` holding them (made from ``options`` when a subclass declares none);
    :meth:`resolve_options` turns what a user or a manifest gave into one, validated with defaults
    filled, once at the edge; every other method takes that object (None: the defaults).
    """

    name: str = ""
    version: int = 1
    activations: tuple[str, ...] = ()
    options: tuple[LayoutOption, ...] = ()
    # vLLM 0.33 ``Mxfp4MoeBackend`` names (fused_moe/oracle/mxfp4.py) that hold this layout's bytes
    # after loading, per activation; mxconv.output.engine_quant_config checks sizes and model against each one.
    vllm_backends: dict[str, tuple[str, ...]] = {}
    # the same per activation for the INT4 form (vLLM ``compressed-tensors`` WNA16 backends) and the
    # MXFP8 form (its ``Fp8MoeBackend`` names); empty: no vLLM backend holds that form of these bytes
    vllm_int4_backends: dict[str, tuple[str, ...]] = {}
    vllm_mxfp8_backends: dict[str, tuple[str, ...]] = {}
    # activations whose kernel tensors hold the source's static FP8 input scales (W4A8): the source
    # must carry them (CanonicalExperts.input_scales); plan refuses one that does not
    input_scale_activations: tuple[str, ...] = ()
    # activation -> how vLLM quantizes the hidden states these experts get, where the activation's name
    # does not say it (mxconv.layouts.activation_quant; triton's W4A8: static per-tensor FP8)
    activation_quant: Mapping[str, ActivationQuant] = {}
    # canonical expert formats (CanonicalExperts.weight_format) this layout takes; plan refuses others
    weight_formats: tuple[str, ...] = ("mxfp4",)
    # canonical weight formats this layout refuses for a reason of its own, format -> why (xpu: MXFP4, whose
    # canonical output is the engine's bytes already); check_weight_format and planning add the why
    weight_format_refusals: Mapping[str, str] = {}
    # describe() keys that hold advice in words (triton's hidden_warning), not a fact about the bytes: verify
    # asks only that one is there where the layout gives one, so rewording advice fails no older output
    advisory_keys: frozenset[str] = frozenset()
    options_type: type[LayoutOptions] = EmptyOptions

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.options_type = _options_type(cls)

    def resolve_options(self, given: LayoutOptions | Mapping[str, Any] | None = None) -> LayoutOptions:
        """``given`` (values, or strings to parse) validated, unknown names refused, defaults filled,
        as this backend's :attr:`options_type`; an object of that type already is returned as is."""
        if isinstance(given, self.options_type):
            return given
        known = {o.name: o for o in self.options}
        given = dict(given.to_json() if isinstance(given, LayoutOptions) else given or {})
        unknown = sorted(set(given) - set(known))
        if unknown:
            listed = ", ".join(known) if known else "none"
            raise LayoutError(f"backend {self.name} has no option {', '.join(unknown)} (its options: {listed})")
        out: dict[str, Any] = {}
        for name, opt in known.items():
            if name not in given:
                out[name] = opt.default
            elif isinstance(given[name], str) and opt.kind is not str:
                out[name] = opt.parse(given[name])
            else:
                out[name] = opt.validate(given[name])
        return self.options_type(**out)

    def options_of(self, options: LayoutOptions | None) -> Any:
        """``options`` as resolved by :meth:`resolve_options` (None: the defaults); TypeError for
        anything else (a dict: resolve it once first)."""
        if options is None:
            return self.resolve_options()
        if not isinstance(options, self.options_type):
            raise TypeError(f"backend {self.name} takes {self.options_type.__name__} options (resolve_options), "
                            f"not {type(options).__name__}")
        return options

    def check_weight_format(self, weight_format: str) -> None:
        """LayoutError unless ``weight_format`` is one of this backend's :attr:`weight_formats`."""
        if weight_format not in self.weight_formats:
            why = self.weight_format_refusals.get(weight_format)
            raise LayoutError(f"{self.name} takes {', '.join(self.weight_formats)} experts, not {weight_format}"
                              + (f": {why}" if why else ""))

    def check_activation(self, activation: str) -> None:
        """LayoutError unless ``activation`` is one this backend serves."""
        check_activation(self.name, activation, self.activations)

    def default_activation(self, weight_format: str = "mxfp4") -> str:
        """The activation a repack of ``weight_format`` experts gets when none is asked for: the first."""
        return self.activations[0]

    def format_activations(self, weight_format: str) -> tuple[str, ...]:
        """The activations a repack of ``weight_format`` experts takes: every one for a format of
        :attr:`weight_formats`, none for another."""
        return self.activations if weight_format in self.weight_formats else ()

    def bias_refusal(self, weight_format: str) -> str | None:
        """Why this layout's bytes for ``weight_format`` experts hold no expert biases (the error a
        repack of a source with them meets while planning); None: they hold them (the default)."""
        return None

    def whole_layers(self, weight_format: str) -> str | None:
        """Why this layout's bytes for ``weight_format`` experts are laid out a whole layer at a time (a
        kernel tensor mixes experts, so a run of experts is not a run of its rows and the memory plan
        may not cut a layer into expert groups); None: any run of experts is its own rows (the default)."""
        return None

    def activation_quantization(self, activation: str, *, weight_format: str = "mxfp4") -> ActivationQuant:
        """How vLLM quantizes the hidden states of ``activation``'s experts: :attr:`activation_quant`'s, else
        what the name says (``weight_format``: the experts'; a layout of one form answers the same for all)."""
        return declared_or_named(self.activation_quant, activation)

    # the engine's own kernel runner for these bytes (``verify --kernel``, the loader): a
    # "module:attribute" string naming a mxconv.engines.runner.EngineRunner, or the object itself;
    # resolved by mxconv.engines (never here: the engines sit above the layouts). None: no runner.
    engine_runner: Any = None

    def float_to_kernel(
        self, t: Mapping[str, torch.Tensor], row_order: str, activation: str, options: LayoutOptions | None,
        fmt: str, scale_rounding: str, kernel_choice: KernelChoice = KernelChoice.AUTO,
    ) -> KernelTensors | None:  # fmt: skip
        """One layer's float experts ``t`` (canonical names) quantized to ``fmt`` with ``scale_rounding``
        and laid out as :meth:`to_kernel` lays that quantization out, in one fused pass (the in-memory
        hand-off); the same bytes as quantizing, then ``to_kernel``. None (the default): no fused pass
        here, or it does not apply to these tensors; the caller then takes the general path."""
        return None

    def stack_choices(self, c: CanonicalExperts, options: LayoutOptions | None) -> dict[str, str]:
        """What :meth:`to_kernel` chooses from ``c``'s data under ``options``, by kernel tensor name
        (e.g. humming's INT4 code form per GEMM): the run records it per layer and rank in the
        manifest (``layout.stack_choices``). None chosen by default."""
        return {}

    def with_choices(self, options: LayoutOptions | None, choices: Mapping[str, str]) -> LayoutOptions:
        """``options`` with ``choices`` (a layer's and rank's recorded :meth:`stack_choices`) fixed,
        for inverting and re-laying those bytes; by default the options as they are."""
        return self.options_of(options)

    def size_warnings(self, hidden_size: int, intermediate_size: int, options: LayoutOptions | None = None) -> list[str]:
        """Plain warnings about sizes the engine accepts but computes wrongly (repack prints them,
        inspect shows them, ``verify --kernel`` fails on them). None by default."""
        return []

    def tp_refusal(self, tp: int, options: LayoutOptions | None = None) -> str | None:
        """Why no engine holds this layout's bytes at tensor-parallel size ``tp`` (planning refuses
        the repack, exit 2, with this text); None by default."""
        return None

    def kernel_unavailable(self, manifest: Manifest, device: Any = "cuda",
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        """Why ``verify --kernel`` cannot run the engine's kernel on ``device`` (kernels looked for at
        ``kernel_locations`` first) for a backend without an :attr:`engine_runner`; backends with one are
        asked through their runner instead. The signature of :func:`mxconv.engines.runner.kernel_unavailable`."""
        return f"no engine kernel runner exists in mxconv for backend {self.name}"


class Layout(Protocol):
    """What every backend module provides (one instance registered per backend)."""

    name: str  # registry name, e.g. "trtllm"
    version: int  # bump when the bytes this module writes change
    activations: tuple[str, ...]  # accepted --activation values; first is the default
    options: tuple[LayoutOption, ...]  # typed options (--layout-option NAME=VALUE)
    vllm_backends: dict[str, tuple[str, ...]]  # activation -> vLLM Mxfp4MoeBackend names served
    vllm_int4_backends: dict[str, tuple[str, ...]]  # the same for the INT4 form (LayoutBase: {})
    vllm_mxfp8_backends: dict[str, tuple[str, ...]]  # the same for the MXFP8 form (LayoutBase: {})
    weight_formats: tuple[str, ...]  # canonical weight formats taken (LayoutBase: ("mxfp4",))
    weight_format_refusals: Mapping[str, str]  # format not taken -> why, where the layout says (LayoutBase: {})
    advisory_keys: frozenset[str]  # describe() keys of advice in words, checked for presence only (LayoutBase: none)
    input_scale_activations: tuple[str, ...]  # activations needing the source's FP8 input scales (LayoutBase: ())
    activation_quant: Mapping[str, ActivationQuant]  # activation -> vLLM's input quantization, where declared (LayoutBase: {})
    options_type: type[LayoutOptions]  # the frozen dataclass resolve_options makes (LayoutBase: from options)

    def resolve_options(self, given: LayoutOptions | Mapping[str, Any] | None = None) -> LayoutOptions:
        """Validated options with defaults filled, as ``options_type`` (LayoutBase provides it)."""
        ...

    def default_activation(self, weight_format: str = "mxfp4") -> str:
        """The activation when none is asked for, for experts of ``weight_format`` (LayoutBase: the first)."""
        ...

    def format_activations(self, weight_format: str) -> tuple[str, ...]:
        """The activations ``weight_format`` experts take (LayoutBase: all of them for a format it takes)."""
        ...

    def bias_refusal(self, weight_format: str) -> str | None:
        """Why ``weight_format``'s bytes hold no expert biases, or None (LayoutBase: None, they hold them)."""
        ...

    def whole_layers(self, weight_format: str) -> str | None:
        """Why ``weight_format``'s bytes are laid out a layer at a time, or None (LayoutBase: None, experts split)."""
        ...

    def activation_quantization(self, activation: str, *, weight_format: str = "mxfp4") -> ActivationQuant:
        """How vLLM quantizes the experts' inputs (LayoutBase: ``activation_quant``, else by the name)."""
        ...

    engine_runner: Any  # "module:attribute" of its mxconv.engines EngineRunner, the runner, or None

    def kernel_unavailable(self, manifest: Manifest, device: Any = "cuda",
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        """Why the engine kernel cannot run when there is no engine_runner (LayoutBase provides one)."""
        ...

    def float_to_kernel(
        self, t: Mapping[str, torch.Tensor], row_order: str, activation: str, options: LayoutOptions | None,
        fmt: str, scale_rounding: str, kernel_choice: KernelChoice = KernelChoice.AUTO,
    ) -> KernelTensors | None:  # fmt: skip
        """Float experts -> kernel tensors in one fused pass, or None (LayoutBase: None, never)."""
        ...

    def stack_choices(self, c: CanonicalExperts, options: LayoutOptions | None) -> dict[str, str]:
        """What to_kernel chooses from ``c``'s data, by tensor name (LayoutBase: {}, nothing)."""
        ...

    def with_choices(self, options: LayoutOptions | None, choices: Mapping[str, str]) -> LayoutOptions:
        """``options`` with recorded stack choices fixed (LayoutBase: the options as they are)."""
        ...

    def tp_refusal(self, tp: int, options: LayoutOptions | None = None) -> str | None:
        """Why no engine would hold this layout's bytes at TP ``tp`` (LayoutBase: None, any TP)."""
        ...

    def padded_sizes(
        self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
        options: LayoutOptions | None = None, *, weight_format: str = "mxfp4",
    ) -> tuple[int, int]:
        """(Hp, Ip) for one rank's (already TP-sliced) sizes under ``options`` (the same object
        kernel_specs/to_kernel get; e.g. trtllm's ``intermediate_align``) for experts of ``weight_format``
        (one of ``weight_formats``; a layout whose forms pad differently answers per form). LayoutError
        if impossible, or for a weight format it does not take."""
        ...

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: LayoutOptions) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the kernel tensors this backend writes for ``sizes``."""
        ...

    def to_kernel(self, c: CanonicalExperts, activation: str, options: LayoutOptions,
                  kernel_choice: KernelChoice = KernelChoice.AUTO) -> KernelTensors:  # fmt: skip
        """Canonical (unpadded) stack -> kernel tensors (padded, permuted), on ``c``'s device.
        ``kernel_choice``: AUTO lets CUDA stacks go through the Triton layout kernels where the
        backend has them, TORCH keeps to torch ops; the bytes are the same."""
        ...

    def from_kernel(
        self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: LayoutOptions
    ) -> CanonicalExperts:
        """Kernel tensors -> canonical stack. Raise LayoutError if a padding region holds other
        than its defined fill (name the tensor and the first offending index)."""
        ...

    def describe(self, sizes: LayoutSizes, activation: str, options: LayoutOptions) -> dict[str, Any]:
        """Manifest `layout` fields owned by the backend: `name`, `version`, `engine_compat`,
        `kernel_params` (filled by the caller for the activation function) and any extras."""
        ...

