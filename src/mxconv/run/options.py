"""The typed options of a conversion, checked and resolved once where they are made (the CLI or a
Python caller), and read as they are everywhere downstream.

Closed sets are Enums whose members are ``str`` (:class:`enum.StrEnum`): they compare equal to,
format as and serialize to their value, so a manifest or config written from them holds the same
bytes as one written from the plain strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Mapping, Sequence

from mxconv.experts.kernel_settings import KernelChoice
from mxconv.layouts.base import LayoutOptions
from mxconv.errors import BadInput
from mxconv.mx.formats import resolve_scale_mode


class WeightFormat(StrEnum):
    """Format of written expert weights: quantize's ``--format``; repack keeps INT4 sources INT4."""

    MXFP4 = "mxfp4"
    MXFP8 = "mxfp8"
    INT4 = "int4"
    FP8_BLOCK = "fp8-block"  # E4M3 + fp32 scale_inv per 128x128 tile (DeepSeek-V3), quantize only


QUANTIZE_FORMATS = (WeightFormat.MXFP4, WeightFormat.MXFP8, WeightFormat.FP8_BLOCK)


class ScaleRounding(StrEnum):
    """E8M0 scale rule (docs/numerics.md); AUTO stands for the format's default and never leaves
    :class:`QuantOptions`, which resolves it (fp8-block, whose tile scales follow their own rule, keeps AUTO)."""

    AUTO = "auto"
    RCEIL = "rceil"
    FLOOR = "floor"
    EVEN = "even"


class Targets(StrEnum):
    """What quantize converts: the routed experts, or every linear layer too (MXFP8)."""

    EXPERTS = "experts"
    LINEAR = "linear"


class Job(StrEnum):
    """The command a plan is for."""

    QUANTIZE = "quantize"
    REPACK = "repack"


class ConversionKind(StrEnum):
    """How one MoE layer's experts become the output's weight format."""

    AS_IS = "as_is"  # the same MX or INT4 format: bytes moved untouched
    MXFP4_TO_MXFP8 = "mxfp4_to_mxfp8"  # lossless re-coding, same scales
    MXFP4_TO_FP8_BLOCK = "mxfp4_to_fp8_block"  # power-of-two tile scales: exact where the tile's spread allows
    QUANTIZE = "quantize"  # floats, or the fp32 dequantization of block-FP8, INT4 or another MX format


def patterns(spec: str | Sequence[str] | None) -> list[str]:
    """``--include`` / ``--ignore`` values as a list (one string, several, or none)."""
    if not spec:
        return []
    return [spec] if isinstance(spec, str) else list(spec)


def name_matches(spec: str | Sequence[str] | None, name: str) -> bool:
    """True when a pattern of ``spec`` matches module ``name``: ``re:REGEX`` as compressed-tensors
    does (``re.match``), anything else as a regular expression found anywhere in the name
    (``re.search``, mxconv's ``--include``/``--ignore`` from the start; an exact module name matches
    itself, and longer names that contain it: anchor it as ``re:NAME$``)."""
    for p in patterns(spec):
        if re.match(p[3:], name) if p.startswith("re:") else re.search(p, name):
            return True
    return False


def check_patterns(setting: str, spec: str | Sequence[str] | None) -> None:
    """BadInput naming ``setting`` (e.g. ``QuantOptions.include``) for a pattern that is not a regular expression."""
    for p in patterns(spec):
        try:
            re.compile(p[3:] if p.startswith("re:") else p)
        except re.error as exc:
            raise BadInput(f"{setting}: invalid regular expression {p!r} ({exc})") from None


def _member(enum: type[StrEnum], value: Any, setting: str, allowed: Sequence[StrEnum] | None = None) -> Any:
    """``value`` (a member or its string) as a member of ``enum``, or BadInput naming the library's
    ``setting`` (e.g. ``QuantOptions.scale_rounding``; the CLI says its flag)."""
    choices = list(allowed or enum)
    try:
        member = enum(value)
    except ValueError:
        member = None
    if member not in choices:
        why = f"{str(value)!r} is not supported; choose one of {', '.join(choices)}"
        raise BadInput(f"{setting} {why}")
    return member


@dataclass(frozen=True)
class QuantOptions:
    """What ``quantize`` (and ``repack`` of a float source) does to expert weights; strings given
    for the closed sets are turned into their Enums, and ``scale_rounding`` "auto" into the format's
    rule (:func:`mxconv.mx.formats.resolve_scale_mode`, where the per-format defaults live), when the options are made: BadInput for a bad value."""

    fmt: WeightFormat = WeightFormat.MXFP4
    scale_rounding: ScaleRounding = ScaleRounding.AUTO
    allow_nonfinite: bool = False
    # patterns (one or a list) over "<module_prefix>.experts" and, with targets "linear", linear
    # module names: a regex found anywhere, or compressed-tensors' "re:REGEX" (re.match); see name_matches
    include: str | tuple[str, ...] | None = None  # default: every MoE layer (and linear)
    ignore: str | tuple[str, ...] | None = None
    targets: Targets = Targets.EXPERTS  # LINEAR: every linear layer too, MXFP8 (mxconv.run.linears)
    skip_unaligned: bool = False  # targets LINEAR: leave a linear whose input is not a multiple of 32 alone
    require_exact: bool = False  # fp8-block from MXFP4: a tile that cannot be re-encoded exactly is an error
    # scale_rounding as first given (AUTO kept; None: take it from scale_rounding), carried through
    # dataclasses.replace: a repack whose experts end up in another MX format than ``fmt`` resolves it again
    # for that format (:meth:`for_format`); two options asking for different rules are not equal
    scale_rounding_given: ScaleRounding | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        fmt = _member(WeightFormat, self.fmt, "QuantOptions.fmt", QUANTIZE_FORMATS)
        rounding = _member(ScaleRounding, self.scale_rounding, "QuantOptions.scale_rounding")
        object.__setattr__(self, "fmt", fmt)
        if self.scale_rounding_given is None:
            object.__setattr__(self, "scale_rounding_given", rounding)
        else:
            given = _member(ScaleRounding, self.scale_rounding_given, "QuantOptions.scale_rounding")
            object.__setattr__(self, "scale_rounding_given", given)
        if fmt == WeightFormat.FP8_BLOCK:
            if rounding != ScaleRounding.AUTO:
                why = ("picks the E8M0 rule of MX formats; fp8-block tile scales are powers of two from MXFP4 sources "
                       "and amax/448 from floats (docs/numerics.md)")
                raise BadInput(f"QuantOptions.scale_rounding {why}")
        else:
            object.__setattr__(self, "scale_rounding", ScaleRounding(resolve_scale_mode(fmt, rounding)))
        if self.require_exact and fmt != WeightFormat.FP8_BLOCK:
            raise BadInput("QuantOptions.require_exact applies to QuantOptions.fmt fp8-block (the re-encode of MXFP4 experts)")
        object.__setattr__(self, "targets", _member(Targets, self.targets, "QuantOptions.targets"))
        for name in ("include", "ignore"):
            spec = getattr(self, name)
            check_patterns(f"QuantOptions.{name}", spec)
            object.__setattr__(self, name, tuple(patterns(spec)) or None)
        if self.targets == Targets.LINEAR and fmt not in (WeightFormat.MXFP8, WeightFormat.FP8_BLOCK):
            raise BadInput("QuantOptions.targets linear quantizes every linear layer to MXFP8 (vLLM's online MXFP8 method) or, "
                           "with QuantOptions.fmt fp8-block, to block FP8; set QuantOptions.fmt mxfp8 or fp8-block")

    def for_format(self, fmt: WeightFormat) -> QuantOptions:
        """These options for experts quantized to ``fmt`` instead: ``scale_rounding`` as given, resolved for
        ``fmt`` (AUTO: ``fmt``'s own rule, as ``QuantOptions(fmt)`` has it)."""
        return replace(self, fmt=fmt, scale_rounding=self.scale_rounding_given)

    def selects(self, module_prefix: str) -> bool:
        """Whether the MoE layer at ``module_prefix`` is converted (``--include`` / ``--ignore``)."""
        target = f"{module_prefix}.experts"
        if self.include and not name_matches(self.include, target):
            return False
        return not (self.ignore and name_matches(self.ignore, target))


@dataclass(frozen=True)
class RepackOptions:
    """What ``repack`` writes: the backend's layout for the engine's activation format, per TP rank;
    ``layout_options``: the backend's own options, as given (a mapping of values or strings) or
    already resolved; the plan resolves them once (``Layout.resolve_options``) and holds the
    resolved :class:`~mxconv.layouts.base.LayoutOptions` from then on."""

    backend: str
    activation: str | None = None  # None: the layout's default for the experts' weight format (the plan resolves it)
    tp: int = 1
    layout_options: LayoutOptions | Mapping[str, Any] = field(default_factory=dict)
    kernel_choice: KernelChoice = KernelChoice.AUTO  # Triton layout kernels on CUDA, or torch ops only (same bytes)
    # the experts' format in the layout: None keeps an MX or INT4 source's format (MXFP8 stays MXFP8,
    # INT4 stays INT4) and makes MXFP4 of anything else (a float source for a layout that takes no MXFP4: the
    # layout's first format, mxconv.run.repack_formats); MXFP8 re-codes MXFP4 (lossless) or quantizes floats
    weight_format: WeightFormat | None = None

    def __post_init__(self) -> None:
        if self.weight_format is not None:
            fmt = _member(WeightFormat, self.weight_format, "RepackOptions.weight_format",
                          (WeightFormat.MXFP4, WeightFormat.MXFP8))
            object.__setattr__(self, "weight_format", fmt)
