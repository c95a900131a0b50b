"""The base of a backend's typed description: the keys of a manifest ``layout`` object that one backend's
``describe()`` writes beyond the typed :class:`~mxconv.source.manifest.LayoutPart` fields (they sit in
``LayoutPart.extra``), read back as one frozen object with typed fields.

A backend declares a frozen dataclass subclass beside its ``describe()`` (``TritonDescription``,
``MarlinDescription``, ``HummingDescription``): each field is named after its JSON key, typed, and, where
a manifest written before the key existed may lack it, defaulted to what the reader assumes then.
:meth:`LayoutDescription.from_layout` reads one (BadInput naming ``layout.<key>`` and the rule when a key
without a default is missing or a value has another type); :meth:`LayoutDescription.to_json` gives
back exactly the keys it was read with. Only shared vocabulary here: no backend is named.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, TypeVar

from mxconv.errors import BadInput
from mxconv.source.manifest import LayoutPart, plain_json

D = TypeVar("D", bound="LayoutDescription")

_RULES: dict[Any, str] = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
                          Mapping: "an object", type(None): "null"}  # fmt: skip


def _accepts(kind: Any, value: Any) -> bool:
    """Whether the JSON ``value`` is of the declared field type ``kind`` (str, int, float, bool, Mapping or a union)."""
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is type(None):
        return value is None
    if kind is str:
        return isinstance(value, str)
    return isinstance(value, Mapping)


def _kinds(hint: Any) -> tuple[Any, ...]:
    """The plain types a field's annotation allows (``int | None`` -> (int, NoneType); ``Mapping[str, Any]`` -> (Mapping,))."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(k for h in typing.get_args(hint) for k in _kinds(h))
    origin = typing.get_origin(hint)
    return ((Mapping,) if origin is not None else (hint,))


@dataclass(frozen=True, kw_only=True)
class LayoutDescription:
    """One backend's own manifest ``layout`` keys, typed (subclass with one field per key).

    ``json_keys``: the keys present, in their order (None: every field, as a writer builds it)."""

    json_keys: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    reader: ClassVar[str] = "this backend"  # who reads the keys, for messages ("the triton engine runner")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The JSON keys this description reads, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "json_keys")

    @classmethod
    def from_layout(cls: type[D], part: LayoutPart) -> D:
        """The description in ``part.extra``: absent keys take the field's default (BadInput naming
        ``layout.<key>`` when the field has none), present ones must be of the field's type."""
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "json_keys":
                continue
            kinds = _kinds(hints[f.name])
            rule = " or ".join(_RULES.get(k, k.__name__) for k in kinds)
            if f.name not in part.extra:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise BadInput(f"manifest layout.{f.name}: missing; {cls.reader} needs it ({rule})")
                continue
            value = part.extra[f.name]
            if not any(_accepts(k, value) for k in kinds):
                raise BadInput(f"manifest layout.{f.name}: {value!r} is not {rule} (what {cls.reader} reads)")
            values[f.name] = value
        return cls(**values, json_keys=tuple(k for k in part.extra if k in values))

    def to_json(self) -> dict[str, Any]:
        """The keys as JSON: those it was read with, in their order (built in code: every field)."""
        return {k: plain_json(getattr(self, k)) for k in (self.json_keys if self.json_keys is not None else self.keys())}


@dataclass(frozen=True, kw_only=True)
class ActivationDescription(LayoutDescription):
    """The one backend key read without knowing the backend: ``activation``, the activation the bytes were
    laid out for, which the layouts' ``describe()`` record (absent or None: the backend's default)."""

    activation: str | None = None

    reader: ClassVar[str] = "the in-memory conversion (update_layer) and a layout's kernel check"


@dataclass(frozen=True, kw_only=True)
class ServingDescription(LayoutDescription):
    """The backend keys read without knowing the backend by who serves an output (the engine quant config,
    mxconv.output.engine_quant_config; the vLLM plugin's backend check): ``vllm_moe_backend``, the vLLM MoE
    backend the bytes are laid out for; ``w13_kernel_row_order``, the order of the w13 rows the kernel tensors
    store; ``arch``, the GPU the bytes are for. Each None where the layout records none."""

    vllm_moe_backend: str | None = None
    w13_kernel_row_order: str | None = None
    arch: str | None = None

    reader: ClassVar[str] = "the engine quant config and the vLLM plugin"
