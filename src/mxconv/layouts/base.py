"""Shared pieces of every backend layout: the canonical MXFP4 expert stack, padding and TP slicing.

A backend layout is a pair of pure functions over a whole expert stack:

    to_kernel(canonical, activation, options)   -> KernelTensors   (padding included)
    from_kernel(kernel, sizes, activation, options) -> CanonicalExperts (padding checked and removed)

Everything is torch tensor arithmetic (index gathers, views, reshapes), so the same code gives the same
bytes on CPU and on CUDA. No per-expert Python loops in the hot path.

Canonical (unpadded) MXFP4 expert stack, one MoE layer, one TP rank:

| field      | shape            | dtype  | meaning |
|------------|------------------|--------|---------|
| w13        | [E, 2I, H/2]     | uint8  | E2M1 pairs, low nibble = even k; rows in `row_order` |
| w13_scale  | [E, 2I, H/32]    | uint8  | E8M0 exponents |
| w2         | [E, H, I/2]      | uint8  | |
| w2_scale   | [E, H, I/32]     | uint8  | |
| w13_bias   | [E, 2I] or None  | any float (bf16 in checkpoints) | rows in `row_order` |
| w2_bias    | [E, H] or None   | any float | |

`row_order` is "interleaved" (gpt-oss: row 2j = gate j, row 2j+1 = up j) or "halves"
(rows [0, I) = gate/w1, rows [I, 2I) = up/w3).

`weight_format` is "mxfp4" (above) or "int4": compressed-tensors INT4, same shapes, w13/w2 bytes
offset-binary int4 pairs (low nibble = even k) and w13_scale/w2_scale **bf16** group-32 scales
(see mxconv.int4). A layout lists the formats it takes in ``LayoutBase.weight_formats``.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import torch

from mxconv.errors import LayoutError

ROW_ORDERS = ("interleaved", "halves")
WEIGHT_FORMATS = ("mxfp4", "int4")

# Names of the kernel tensors every backend produces (vLLM FusedMoE parameter names, without prefix).
KERNEL_TENSOR_NAMES = (
    "w13_weight",
    "w13_weight_scale",
    "w13_bias",
    "w2_weight",
    "w2_weight_scale",
    "w2_bias",
)


def round_up(x: int, m: int) -> int:
    """Smallest multiple of ``m`` that is >= ``x``."""
    return ((x + m - 1) // m) * m


@dataclass
class CanonicalExperts:
    """One MoE layer's MXFP4 experts in canonical form (see module docstring for shapes)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    row_order: str = "halves"
    weight_format: str = "mxfp4"  # "mxfp4" | "int4" (bf16 scales)

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def hidden_size(self) -> int:
        """H: input width of w13 (= output rows of w2)."""
        return int(self.w13.shape[2]) * 2

    @property
    def intermediate_size(self) -> int:
        """I: per-expert intermediate width (w13 has 2I rows)."""
        return int(self.w13.shape[1]) // 2

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def to(self, device: torch.device | str) -> "CanonicalExperts":
        """Copy every tensor to ``device`` (non-blocking where possible)."""

        # non_blocking only host -> device: a device -> host copy must be complete before use.
        non_blocking = torch.device(device).type != "cpu"

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            w13=mv(self.w13),
            w13_scale=mv(self.w13_scale),
            w2=mv(self.w2),
            w2_scale=mv(self.w2_scale),
            w13_bias=mv(self.w13_bias),
            w2_bias=mv(self.w2_bias),
        )

    def validate(self) -> None:
        """Raise LayoutError unless shapes/dtypes are a consistent canonical stack."""
        if self.row_order not in ROW_ORDERS:
            raise LayoutError(f"unknown w13 row order {self.row_order!r} (expected one of {ROW_ORDERS})")
        if self.weight_format not in WEIGHT_FORMATS:
            raise LayoutError(f"unknown expert weight format {self.weight_format!r} (expected one of {WEIGHT_FORMATS})")
        scale_dtype = torch.bfloat16 if self.weight_format == "int4" else torch.uint8
        E, n13, hb = self.w13.shape
        H, I = hb * 2, n13 // 2
        want = {
            "w13": (self.w13, (E, 2 * I, H // 2)),
            "w13_scale": (self.w13_scale, (E, 2 * I, H // 32)),
            "w2": (self.w2, (E, H, I // 2)),
            "w2_scale": (self.w2_scale, (E, H, I // 32)),
        }
        if n13 % 2:
            raise LayoutError(f"w13 has an odd number of rows ({n13}); expected 2*I")
        if H % 32 or I % 32:
            raise LayoutError(f"hidden ({H}) and intermediate ({I}) sizes must be multiples of 32 for MXFP4")
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape:
                raise LayoutError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
            want_dtype = scale_dtype if name.endswith("_scale") else torch.uint8
            if t.dtype != want_dtype:
                raise LayoutError(f"{name} has dtype {t.dtype}, expected {want_dtype}")
        if (self.w13_bias is None) != (self.w2_bias is None):
            raise LayoutError("w13_bias and w2_bias must both be present or both absent (give both w13_bias and w2_bias, or neither)")
        if self.w13_bias is not None and tuple(self.w13_bias.shape) != (E, 2 * I):
            raise LayoutError(f"w13_bias has shape {tuple(self.w13_bias.shape)}, expected {(E, 2 * I)}")
        if self.w2_bias is not None and tuple(self.w2_bias.shape) != (E, H):
            raise LayoutError(f"w2_bias has shape {tuple(self.w2_bias.shape)}, expected {(E, H)}")


@dataclass(frozen=True)
class LayoutSizes:
    """Unpadded and padded sizes of one rank's expert stack."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    padded_hidden_size: int
    padded_intermediate_size: int
    row_order: str
    has_bias: bool
    weight_format: str = "mxfp4"  # canonical expert format the kernel tensors hold ("mxfp4" | "int4")


# Kernel tensors: name (see KERNEL_TENSOR_NAMES) -> tensor. Biases absent when the model has none.
KernelTensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TensorSpec:
    """Planned shape and dtype of one output tensor (used by --dry-run, inspect and the writer)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


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


class LayoutBase:
    """Shared behaviour of every backend layout (subclass it and declare the class attributes).

    ``options`` declares the backend's typed options; :meth:`resolve_options` turns what a user or a
    manifest gave into a complete, validated dict (defaults filled), which every other method takes.
    """

    name: str = ""
    version: int = 1
    activations: tuple[str, ...] = ()
    options: tuple[LayoutOption, ...] = ()
    # vLLM 0.33 ``Mxfp4MoeBackend`` names (fused_moe/oracle/mxfp4.py) that hold this layout's bytes
    # after loading, per activation; mxconv.engine_config checks sizes and model against each one.
    vllm_backends: dict[str, tuple[str, ...]] = {}
    # canonical expert formats (CanonicalExperts.weight_format) this layout takes; plan refuses others
    weight_formats: tuple[str, ...] = ("mxfp4",)

    def resolve_options(self, given: dict[str, Any] | None = None) -> dict[str, Any]:
        """``given`` (values, or strings to parse) validated, unknown names refused, defaults filled."""
        known = {o.name: o for o in self.options}
        given = dict(given or {})
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
        return out

    def check_activation(self, activation: str) -> None:
        """LayoutError unless ``activation`` is one this backend serves."""
        if activation not in self.activations:
            raise LayoutError(
                f"{self.name} does not support activation {activation!r}; supported: {', '.join(self.activations)}"
            )

    # module whose kernel_unavailable(manifest) / run_kernel_layer(...) drive the engine's own
    # kernel for this layout (``verify --kernel``, the loader); None: no runner in mxconv
    kernel_runner: str | None = None

    def size_warnings(self, hidden_size: int, intermediate_size: int, options: dict[str, Any] | None = None) -> list[str]:
        """Plain warnings about sizes the engine accepts but computes wrongly (repack prints them,
        inspect shows them, ``verify --kernel`` fails on them). None by default."""
        return []

    def kernel_unavailable(self, manifest: dict[str, Any]) -> str | None:
        """None when ``verify --kernel`` can run the engine's kernel on this machine for an output
        described by ``manifest``; otherwise the reason, naming what is missing."""
        if self.kernel_runner is None:
            return f"no engine kernel runner exists in mxconv for backend {self.name}"
        return importlib.import_module(self.kernel_runner).kernel_unavailable(manifest)

    def run_kernel(self, root: Any, manifest: dict[str, Any], layer: int, hidden: torch.Tensor, routing: Any) -> torch.Tensor:
        """The engine kernel's MoE output [T, H] fp32 for ``hidden`` [T, H] fp32 and ``routing``
        (top-k ``ids``/``weights``), summed over TP ranks (only when :meth:`kernel_unavailable` is None)."""
        if self.kernel_runner is None:
            raise LayoutError(self.kernel_unavailable(manifest) or f"backend {self.name} cannot run a kernel")
        return importlib.import_module(self.kernel_runner).run_kernel_layer(root, manifest, layer, hidden, routing)


class Layout(Protocol):
    """What every backend module provides (one instance registered per backend)."""

    name: str  # registry name, e.g. "trtllm"
    version: int  # bump when the bytes this module writes change
    activations: tuple[str, ...]  # accepted --activation values; first is the default
    options: tuple[LayoutOption, ...]  # typed options (--layout-option NAME=VALUE)
    vllm_backends: dict[str, tuple[str, ...]]  # activation -> vLLM Mxfp4MoeBackend names served
    weight_formats: tuple[str, ...]  # canonical weight formats taken (LayoutBase: ("mxfp4",))

    def resolve_options(self, given: dict[str, Any] | None = None) -> dict[str, Any]:
        """Validated options with defaults filled (LayoutBase provides it)."""
        ...

    def kernel_unavailable(self, manifest: dict[str, Any]) -> str | None:
        """None when the engine kernel can run here, else why not (LayoutBase provides a default)."""
        ...

    def padded_sizes(
        self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
        options: dict[str, Any] | None = None,
    ) -> tuple[int, int]:
        """(Hp, Ip) for one rank's (already TP-sliced) sizes under ``options`` (the same dict
        kernel_specs/to_kernel get; e.g. trtllm's ``intermediate_align``). LayoutError if impossible."""
        ...

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: dict[str, Any]) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the kernel tensors this backend writes for ``sizes``."""
        ...

    def to_kernel(self, c: CanonicalExperts, activation: str, options: dict[str, Any]) -> KernelTensors:
        """Canonical (unpadded) stack -> kernel tensors (padded, permuted), on ``c``'s device."""
        ...

    def from_kernel(
        self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: dict[str, Any]
    ) -> CanonicalExperts:
        """Kernel tensors -> canonical stack. Raise LayoutError if a padding region holds other
        than its defined fill (name the tensor and the first offending index)."""
        ...

    def describe(self, sizes: LayoutSizes, activation: str, options: dict[str, Any]) -> dict[str, Any]:
        """Manifest `layout` fields owned by the backend: `name`, `version`, `engine_compat`,
        `kernel_params` (filled by the caller for the activation function) and any extras."""
        ...


# ---------------------------------------------------------------------------------------------
# Padding shared by all backends: vLLM allocates zeroed params at padded sizes and copies the
# checkpoint into the leading corner; for the halves order each half is padded on its own.
# ---------------------------------------------------------------------------------------------


def _pad_rows(t: torch.Tensor, rows: int, row_order: str, fill: int | float) -> torch.Tensor:
    """Pad dim 1 of a w13-like tensor [E, 2I, ...] to [E, 2*Ip, ...] following ``row_order``."""
    E, n = t.shape[0], t.shape[1]
    I, Ip = n // 2, rows // 2
    if n == rows:
        return t
    out = torch.full((E, rows, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    if row_order == "halves":
        out[:, :I] = t[:, :I]
        out[:, Ip : Ip + I] = t[:, I:]
    else:
        out[:, :n] = t
    return out


def pad_last(t: torch.Tensor, cols: int, fill: int | float) -> torch.Tensor:
    """Pad the last axis of ``t`` to ``cols`` with ``fill`` (``t`` itself when already that wide)."""
    if t.shape[-1] == cols:
        return t
    out = torch.full((*t.shape[:-1], cols), fill, dtype=t.dtype, device=t.device)
    out[..., : t.shape[-1]] = t
    return out


def _pad_dim1(t: torch.Tensor, rows: int, fill: int | float) -> torch.Tensor:
    if t.shape[1] == rows:
        return t
    out = torch.full((t.shape[0], rows, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    out[:, : t.shape[1]] = t
    return out


def pad_canonical(c: CanonicalExperts, Hp: int, Ip: int, scale_fill: int = 0) -> CanonicalExperts:
    """Pad a canonical stack to (Hp, Ip): zero weights, ``scale_fill`` scales, zero biases.

    w13 rows follow the row order (interleaved: new pairs appended; halves: each half padded),
    columns (the K axis) are padded at the end; w2 rows padded at the end.
    """
    H, I = c.hidden_size, c.intermediate_size
    if Hp < H or Ip < I:
        raise LayoutError(f"padded sizes ({Hp}, {Ip}) smaller than ({H}, {I})")
    w13 = pad_last(_pad_rows(c.w13, 2 * Ip, c.row_order, 0), Hp // 2, 0)
    s13 = pad_last(_pad_rows(c.w13_scale, 2 * Ip, c.row_order, scale_fill), Hp // 32, scale_fill)
    w2 = pad_last(_pad_dim1(c.w2, Hp, 0), Ip // 2, 0)
    s2 = pad_last(_pad_dim1(c.w2_scale, Hp, scale_fill), Ip // 32, scale_fill)
    b13 = None if c.w13_bias is None else _pad_rows(c.w13_bias, 2 * Ip, c.row_order, 0)
    b2 = None if c.w2_bias is None else _pad_dim1(c.w2_bias, Hp, 0)
    return CanonicalExperts(w13, s13, w2, s2, b13, b2, c.row_order, c.weight_format)


def pad_row_source(rows: int, padded_rows: int, row_order: str | None = None) -> torch.Tensor:
    """Row of the unpadded tensor that each row of its padded version holds (pad_canonical's rule),
    -1 for padding rows. CPU LongTensor [padded_rows].

    ``row_order="halves"`` (w13 and its scales/bias: rows = 2I, padded_rows = 2Ip): each half padded
    on its own; otherwise rows are appended at the end (interleaved w13, w2).
    """
    if padded_rows < rows:
        raise LayoutError(f"padded row count {padded_rows} smaller than {rows}")
    p = torch.arange(padded_rows, dtype=torch.long)
    if row_order == "halves" and padded_rows != rows:
        if rows % 2 or padded_rows % 2:
            raise LayoutError(f"halves row order needs even row counts, got {rows} -> {padded_rows}")
        half, padded_half = rows // 2, padded_rows // 2
        upper = p >= padded_half
        local = torch.where(upper, p - padded_half, p)
        src = local + torch.where(upper, half, 0)
        return torch.where(local < half, src, -1)
    return torch.where(p < rows, p, -1)


def layout_kernels(t: torch.Tensor) -> Any:
    """The Triton layout-kernel module (``mxconv.kernels.layout_triton``) when ``t`` is a CUDA tensor
    and the kernels are enabled there, else None (use the torch path). Imports triton lazily."""
    if not t.is_cuda:
        return None
    from mxconv.kernels import layout_triton

    return layout_triton if layout_triton.layout_kernels_enabled(t) else None


_INDEX_CACHE: dict[tuple[Any, ...], torch.Tensor] = {}
_INDEX_CACHE_MAX = 256


def cached_index(key: tuple[Any, ...], device: torch.device | str | None, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()`` (an index tensor, any device) as int32 on ``device``, computed once per (key, device).

    int32 is what the Triton kernels read and what ``index_select`` accepts. The returned tensor is
    shared between callers: never modify it in place.
    """
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    full_key = (*key, str(dev))
    hit = _INDEX_CACHE.get(full_key)
    if hit is None:
        if len(_INDEX_CACHE) >= _INDEX_CACHE_MAX:
            _INDEX_CACHE.clear()
        hit = build().to(device=dev, dtype=torch.int32).contiguous()
        _INDEX_CACHE[full_key] = hit
    return hit


def _word_dtype(nbytes: int) -> torch.dtype:
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if nbytes % size == 0:
            return dtype
    return torch.uint8


def gather_padded_rows(t: torch.Tensor, tab: torch.Tensor, cols: int | None = None, fill: int | float = 0) -> torch.Tensor:
    """Rows of ``t`` [E, R, *rest] picked by ``tab`` (int32/int64 [R_out] on t's device, -1 =
    a row of ``fill``), last dim padded to ``cols`` with ``fill``: the padding of
    :func:`pad_canonical` and any row permutation in one gather. Returns [E, R_out, *rest'].
    """
    E, R = t.shape[0], t.shape[1]
    rest = tuple(t.shape[2:])
    out_rest = rest if cols is None or not rest else (*rest[:-1], cols)
    ext = torch.empty((E, R + 1, *out_rest), dtype=t.dtype, device=t.device)
    if rest and out_rest[-1] != rest[-1]:
        ext[:, :R, ..., : rest[-1]] = t
        ext[:, :R, ..., rest[-1] :] = fill
    else:
        ext[:, :R] = t
    ext[:, R] = fill
    idx = torch.where(tab < 0, R, tab)
    row_bytes = math.prod(out_rest) * t.element_size()
    if rest and t.dtype == torch.uint8 and ext.is_contiguous():
        word = _word_dtype(row_bytes)
        wide = ext.view(E, R + 1, row_bytes).view(word)
        return wide.index_select(1, idx).view(torch.uint8).view(E, int(idx.numel()), *out_rest)
    return ext.index_select(1, idx)


def _check_fill(name: str, region: torch.Tensor, fill: int | float, offset: tuple[int, ...]) -> None:
    """Raise LayoutError naming the first element of ``region`` that is not ``fill``."""
    if region.numel() == 0:
        return
    bad = region != fill
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0].tolist()]
        where = tuple(o + i for o, i in zip(offset, idx))
        raise LayoutError(
            f"padding of {name} at index {list(where)} holds {region[tuple(idx)].item()!r}, expected {fill!r}"
        )


def unpad_canonical(
    c: CanonicalExperts, H: int, I: int, scale_fill: int | None = 0, check: bool = True
) -> CanonicalExperts:
    """Inverse of :func:`pad_canonical`: crop to (H, I), checking every padding region holds its fill.

    ``scale_fill=None`` skips the scale-padding check (bytes the engine leaves undefined).
    """
    Ip = c.intermediate_size
    halves = c.row_order == "halves"

    def rows13(t: torch.Tensor) -> torch.Tensor:
        if halves:
            return torch.cat([t[:, :I], t[:, Ip : Ip + I]], dim=1)
        return t[:, : 2 * I]

    if check:
        pads13 = [(I, Ip), (Ip + I, 2 * Ip)] if halves else [(2 * I, 2 * Ip)]
        checks: list[tuple[str, torch.Tensor, int | float | None, int]] = [
            ("w13_weight", c.w13, 0, H // 2),
            ("w13_weight_scale", c.w13_scale, scale_fill, H // 32),
        ]
        for name, t, fill, kcols in checks:
            if fill is None:
                continue
            for lo, hi in pads13:
                _check_fill(name, t[:, lo:hi], fill, (0, lo, 0))
            _check_fill(name, t[..., kcols:], fill, (0, 0, kcols))
        for name, t, fill, kcols in (("w2_weight", c.w2, 0, I // 2), ("w2_weight_scale", c.w2_scale, scale_fill, I // 32)):
            if fill is None:
                continue
            _check_fill(name, t[:, H:], fill, (0, H, 0))
            _check_fill(name, t[..., kcols:], fill, (0, 0, kcols))
        if c.w13_bias is not None:
            for lo, hi in pads13:
                _check_fill("w13_bias", c.w13_bias[:, lo:hi], 0, (0, lo))
        if c.w2_bias is not None:
            _check_fill("w2_bias", c.w2_bias[:, H:], 0, (0, H))
    return CanonicalExperts(
        w13=rows13(c.w13)[..., : H // 2].contiguous(),
        w13_scale=rows13(c.w13_scale)[..., : H // 32].contiguous(),
        w2=c.w2[:, :H, : I // 2].contiguous(),
        w2_scale=c.w2_scale[:, :H, : I // 32].contiguous(),
        w13_bias=None if c.w13_bias is None else rows13(c.w13_bias).contiguous(),
        w2_bias=None if c.w2_bias is None else c.w2_bias[:, :H].contiguous(),
        row_order=c.row_order,
        weight_format=c.weight_format,
    )


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: the intermediate axis is split in whole 32-element blocks (vLLM's loader).
# ---------------------------------------------------------------------------------------------


def tp_ranges(intermediate_size: int, tp: int) -> list[tuple[int, int]]:
    """[start, end) of the intermediate axis for each rank: per_rank = ceil((I/32)/tp)*32."""
    if tp < 1:
        raise LayoutError(f"--tp must be >= 1, got {tp}")
    if intermediate_size % 32:
        raise LayoutError(f"intermediate size {intermediate_size} is not a multiple of 32")
    per_rank = -(-(intermediate_size // 32) // tp) * 32
    ranges = []
    for r in range(tp):
        start = min(r * per_rank, intermediate_size)
        end = min((r + 1) * per_rank, intermediate_size)
        ranges.append((start, end))
    if any(e <= s for s, e in ranges):
        raise LayoutError(
            f"--tp {tp} leaves a rank with no intermediate channels (I = {intermediate_size}, "
            f"split in blocks of 32): use a smaller --tp"
        )
    return ranges


def slice_tp(c: CanonicalExperts, start: int, end: int, rank: int, pad_to: int | None = None) -> CanonicalExperts:
    """Rank's share of a canonical stack: intermediate channels [start, end).

    w13 rows: interleaved -> [2*start, 2*end); halves -> gate[start:end] ++ up[start:end].
    w2 columns: bytes [start/2, end/2), scale columns [start/32, end/32).
    w2 bias: kept on rank 0 only, zero on the others (the engine sums rank outputs).
    ``pad_to``: zero-pad a narrower last rank to this intermediate width (the widest rank's), so
    every rank's kernel tensors have one shape; the bytes equal padding straight to the layout's Ip.
    """
    I = c.intermediate_size
    if c.row_order == "interleaved":
        r13 = slice(2 * start, 2 * end)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t[:, r13]

    else:

        def rows(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[:, start:end], t[:, I + start : I + end]], dim=1)

    w2_bias = c.w2_bias
    if w2_bias is not None and rank != 0:
        w2_bias = torch.zeros_like(w2_bias)
    part = CanonicalExperts(
        w13=rows(c.w13).contiguous(),
        w13_scale=rows(c.w13_scale).contiguous(),
        w2=c.w2[..., start // 2 : end // 2].contiguous(),
        w2_scale=c.w2_scale[..., start // 32 : end // 32].contiguous(),
        w13_bias=None if c.w13_bias is None else rows(c.w13_bias).contiguous(),
        w2_bias=None if w2_bias is None else w2_bias.contiguous(),
        row_order=c.row_order,
        weight_format=c.weight_format,
    )
    if pad_to is not None and pad_to > end - start:
        part = pad_canonical(part, part.hidden_size, pad_to)
    return part
