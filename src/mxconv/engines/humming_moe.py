"""Run a MoE layer through humming-kernels' own GEMMs (``humming.forward.humming_forward``, the call
vLLM 0.33's ``HummingGroupedExperts`` makes) on the tensors exactly as ``mxconv repack --backend
humming`` writes them (docs/layout-humming.md).

humming is found as an installed package or on ``PYTHONPATH`` (``pip install --no-deps --target DIR
humming-kernels==0.1.19``); it JIT-compiles its kernels through NVRTC on first use. The layer
configs come from the manifest (``layout.layer_configs``); their ``sm_version`` must be this GPU's.

Forward: tokens grouped by expert (grouped_contiguous, offsets [E+1]) -> GEMM 1 (N = 2Ip) ->
activation in fp32 (gpt-oss interleaved pairs: clamped SwiGLU-OAI; halves: SiLU) -> GEMM 2 ->
router weights and the sum over the k experts in torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from mxconv.engines import discover
from mxconv.engines.runner import SWIGLU_ALPHA, SWIGLU_LIMIT, LayerSpec, gated_activation, softmax_topk
from mxconv.errors import BadInput
from mxconv.experts.kernel_settings import KernelLocations
from mxconv.experts.stack import LayoutSizes
from mxconv.layouts.humming import LAYOUT, HummingDescription, layer_configs
from mxconv.source.manifest import LayoutPart

HUMMING_VERSION = "0.1.19"
GEMM_TYPE = "grouped_contiguous"


def import_humming() -> Any:
    """The ``humming`` package; BadInput saying how to get it when it does not import."""
    try:
        import humming
        import humming.forward
    except ImportError as exc:
        raise BadInput(f"humming-kernels is not importable ({exc}); install it with 'pip install --no-deps "
                       f"humming-kernels=={HUMMING_VERSION}' or put it on PYTHONPATH") from None  # fmt: skip
    version = str(getattr(humming, "__version__", "?"))
    if not version.startswith(HUMMING_VERSION):
        raise BadInput(f"humming-kernels {version} found; this layout is humming-kernels {HUMMING_VERSION}'s")
    return humming


def device_sm(device: Any) -> int:
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return 10 * major + minor


def check_layer_sm(d: HummingDescription, device: Any) -> None:
    """BadInput unless the manifest's layer configs (``d``) target this GPU's SM (humming's bytes differ per SM)."""
    want = d.sm_version
    have = device_sm(device)
    if want != have:
        raise BadInput(f"this humming output was laid out for SM{want} (layout.sm_version); the GPU is SM{have}: "
                       "humming's weight layout differs per SM, repack on a matching target")  # fmt: skip


@dataclass
class HummingExperts:
    """One rank's stored tensors with humming's layer configs (w13, w2) and the kernel's locks."""

    tensors: dict[str, torch.Tensor]
    configs: dict[str, Any]
    tuning: dict[str, str]
    locks: torch.Tensor
    num_experts: int
    hidden_size: int
    intermediate: int  # Ip: GEMM 1 gives 2*Ip columns
    row_order: str
    activation: str
    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: float = SWIGLU_LIMIT

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """GEMM-1 output [M, 2Ip] -> [M, Ip] bf16 (vLLM humming/activation.py's formulas)."""
        return gated_activation(h, self.row_order, self.activation, self.intermediate, "humming",
                                self.swiglu_alpha, self.swiglu_limit)  # fmt: skip

    def _gemm(self, w: str, x: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
        from humming.forward import humming_forward

        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=x.device)
        return humming_forward(
            self.configs[w], inputs=x, weight=self.tensors[f"{w}_weight"],
            weight_scale=self.tensors[f"{w}_weight_scale"], bias=self.tensors.get(f"{w}_bias"), outputs=out,
            expert_layout=offsets, locks=self.locks, valid_shape_m=int(x.shape[0]),
            compute_config=json.dumps({"gemm_type": GEMM_TYPE}), tuning_config=self.tuning[w],
        )  # fmt: skip

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ``ids`` [T, k], ``weights`` [T, k] on the experts' device -> [T, H] bf16."""
        T, k = ids.shape
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).long()
        grouped = x.to(torch.bfloat16).repeat_interleave(k, dim=0)[order].contiguous()
        h = self._gemm("w13", grouped, offsets, 2 * self.intermediate)
        y_grouped = self._gemm("w2", self.activate(h), offsets, self.hidden_size)
        y = torch.empty_like(y_grouped)
        y[order] = y_grouped
        return (y.view(T, k, -1).float() * weights.float()[..., None]).sum(dim=1).to(torch.bfloat16)


def _check_tensors(tensors: dict[str, torch.Tensor], cfgs: dict[str, dict[str, Any]], name: str) -> dict[str, torch.Tensor]:
    held = {}
    for w in ("w13", "w2"):
        cfg = cfgs[w]
        E, n, kk = int(cfg["num_experts"]), int(cfg["shape_n"]), int(cfg["shape_k"])
        scale_dtype = torch.bfloat16 if cfg.get("bs_dtype") == "bfloat16" else torch.float8_e8m0fnu  # INT4: bf16
        words = 4 * n if cfg.get("b_dtype") == "float8e4m3" else 2 * n  # four E4M3 bytes or eight nibbles a word
        want = {f"{w}_weight": ((E, kk // 16, words), torch.int32),
                f"{w}_weight_scale": ((E, kk // 32, n), scale_dtype)}  # fmt: skip
        if cfg.get("has_bias"):
            want[f"{w}_bias"] = ((E, n), torch.bfloat16)
        for key, (shape, dtype) in want.items():
            t = tensors.get(key)
            if t is None:
                raise BadInput(f"{name}.{key}: missing")
            if t.dtype == torch.uint8 and dtype == torch.float8_e8m0fnu:
                t = t.view(dtype)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise BadInput(f"{name}.{key}: stored {t.dtype}{list(t.shape)}, humming's layer config needs {dtype}{list(shape)}")
            held[key] = t.contiguous()
    return held


class HummingRunner:
    """The :class:`~mxconv.engines.runner.EngineRunner` of ``--backend humming``."""

    device = "cuda"
    what = "humming-kernels' MoE GEMMs"

    def check_device(self, device: Any) -> None:
        discover.check_gpu(device, exact=None, minimum=(9, 0), what=self.what)

    def kernel_unavailable(self, layout: LayoutPart, device: Any,
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        d = HummingDescription.from_layout(layout)
        self.check_device(device)
        import_humming()
        check_layer_sm(d, device)
        if d.layer_configs is None:
            return "the manifest's layout has no humming layer_configs"
        return None

    def wrap(self, tensors: dict[str, torch.Tensor], spec: LayerSpec,
             kernel_locations: KernelLocations | None = None) -> HummingExperts:  # fmt: skip
        """One rank's tensors checked against the manifest's layer configs and held."""
        d, rank_intermediate_size = HummingDescription.from_layout(spec.layout), spec.rank_intermediate_size
        device = tensors["w13_weight"].device
        self.check_device(device)
        import_humming()
        check_layer_sm(d, device)
        from humming.config import LayerConfig
        from humming.tune import get_heuristics_config

        name, E, H = spec.name, spec.num_experts, spec.hidden_size
        row_order, fmt = d.w13_kernel_row_order, d.variant  # int4 / mxfp8 layouts record their variant
        _, ip = LAYOUT.padded_sizes(H, rank_intermediate_size, row_order, "bf16", weight_format=fmt)
        sizes = LayoutSizes(E, H, rank_intermediate_size, H, ip, row_order, "w13_bias" in tensors, fmt)
        # this rank's (TP ranks may differ in I); INT4 codes: this layer's and rank's recorded choice
        # (layout.stack_choices), else the one int4_codes value of an output written before they were recorded
        codes = dict(spec.stack_choices) or d.int4_codes
        cfgs = layer_configs(sizes, codes)
        configs = {w: LayerConfig(**cfgs[w]) for w in ("w13", "w2")}
        tuning = {w: json.dumps(get_heuristics_config(layer_config=c, gemm_type=GEMM_TYPE, device=device))
                  for w, c in configs.items()}  # fmt: skip
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        ip = (configs["w13"].shape_n - configs["w13"].pad_shape_n) // 2
        return HummingExperts(
            _check_tensors(tensors, cfgs, name), configs, tuning,
            torch.zeros(sms * 8, dtype=torch.int32, device=device), E, H, ip, row_order, spec.activation,
            spec.swiglu_alpha, spec.swiglu_limit,
        )  # fmt: skip

    def forward(self, experts: HummingExperts, x: torch.Tensor, topk_ids: torch.Tensor | None,
                topk_weights: torch.Tensor | None, logits: torch.Tensor | None, info: Any) -> torch.Tensor:  # fmt: skip
        """Top-k from ``logits`` in torch when no ids are given, then humming's two GEMMs."""
        if topk_ids is None:
            topk_ids, topk_weights = softmax_topk(logits, info.top_k, bool(info.norm_topk_prob), info.routing)  # type: ignore[arg-type]
        return experts.forward(x, topk_ids, topk_weights)  # type: ignore[arg-type]


RUNNER = HummingRunner()
