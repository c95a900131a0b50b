"""verify, check 3 (numerics): seeded hidden states through router + experts of the converted
weights vs the reference (a source checkpoint or outputs saved earlier), with per-format thresholds.
A value that is not a number fails, never passes."""

from __future__ import annotations

from pathlib import Path

import torch

from mxconv.experts.stack import CanonicalExperts
from mxconv.source.checkpoint import Checkpoint
from mxconv.errors import BadInput
from mxconv.families.base import FP8BlockStack, Int4Stack, ModelInfo, MoELayer, MXStack, nonfinite_tensors
from mxconv.verify.reference_moe import ExpertFn, LayerForward, Routing, apart, compare, hidden_states, moe_forward, route
from mxconv.source.st_format import read_tensor
from mxconv.verify.layout import canonical_stack, kernel_nonfinite
from mxconv.verify.report import THRESHOLDS, LayerReport
from mxconv.verify.state import VerifyState
from mxconv.source.manifest import LayerEntry

_FORMAT_CODES = ("float", "mxfp4", "mxfp8", "int4")


def _same_mx_bytes(reference_format: str, converted_format: str) -> bool:
    """True when the converted weights hold exactly the reference's values: same MX format, or an
    MXFP4 reference converted to MXFP8 (lossless). Then the outputs must match exactly."""
    return reference_format == converted_format or (reference_format == "mxfp4" and converted_format == "mxfp8")


def _weights(layer: MoELayer, which: str) -> MXStack | FP8BlockStack | torch.Tensor:
    """A layer's stack in whatever form the reader gave it (MX, block-FP8, INT4 or float)."""
    for form in (f"{which}_mx", f"{which}_fp8", f"{which}_int4", which):
        t = getattr(layer, form)
        if t is not None:
            return t
    raise BadInput(f"{layer.ref.module_prefix}.experts: no {which} weights")


def expert_fn(w13: MXStack | FP8BlockStack | torch.Tensor, w2: MXStack | FP8BlockStack | torch.Tensor, b13: torch.Tensor | None,
              b2: torch.Tensor | None, device: torch.device | str = "cpu") -> ExpertFn:
    """Per-expert fp32 weights on ``device``, dequantized there on demand (one expert at a time)."""
    from mxconv.mx.numerics import dequantize_mx

    def get(t: MXStack | FP8BlockStack | torch.Tensor, e: int) -> torch.Tensor:
        if isinstance(t, MXStack):
            return dequantize_mx(t.data[e].to(device), t.scales[e].to(device), t.fmt)
        if isinstance(t, (FP8BlockStack, Int4Stack)):  # exact fp32 dequantization
            return t.dequantize(e, e + 1, device)[0]
        return t[e].to(device).float()

    def bias(b: torch.Tensor | None, e: int) -> torch.Tensor | None:
        return None if b is None else b[e].to(device).float()

    def fn(e: int):
        return (get(w13, e), get(w2, e), bias(b13, e), bias(b2, e))

    return fn


def _router(ckpt: Checkpoint, lay: LayerEntry) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    def opt(name: str | None) -> torch.Tensor | None:
        return None if not name else ckpt.read(name).float()

    return ckpt.read(lay.router_weight).float(), opt(lay.router_bias), opt(lay.correction_bias)


def _output_nonfinite(out: torch.Tensor, what: str) -> str | None:
    """Describe the first NaN/Inf of a runner output [tokens, hidden]; None when it is finite."""
    from mxconv.mx.numerics import first_nonfinite

    idx = first_nonfinite(out)
    if idx is None:
        return None
    return f"the {what} holds {out[idx].item()} (token {idx[0]}, channel {idx[1]}): a non-finite output never passes"


def run_layer(info: ModelInfo, row_order: str, experts: ExpertFn, router: tuple, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
    """The reference MoE output [T, H] fp32 of one layer and its routing (top-k ids and weights)."""
    rw, rb, cb = (None if t is None else t.to(x.device) for t in router)
    r = route(x, rw, info, rb, cb)
    out = moe_forward(x, r, experts, info.num_experts, info, row_order).cpu()
    return out, Routing(r.ids.cpu(), r.weights.cpu())


def converted_nonfinite(state: VerifyState, lay: LayerEntry, canon: CanonicalExperts | None, conv_layer: MoELayer | None) -> str | None:
    """The first value of the converted layer that is not a number (NaN scale byte, NaN/Inf bias or
    router), named by tensor and index; None when every value is one."""
    if conv_layer is not None and state.own_reader is not None:
        return state.own_reader.nonfinite_problem(conv_layer)
    if canon is None:
        return None
    bad = kernel_nonfinite(canon, lay.module_prefix)
    if bad is None:
        try:
            bad = nonfinite_tensors(state.plan.ckpts[0], (lay.router_weight, lay.router_bias, lay.correction_bias))
        except BadInput:
            pass  # a router the checkpoint lacks: the integrity check names it
    return bad


def check_layer_numerics(state: VerifyState, L: int, lay: LayerEntry, canon: CanonicalExperts | None, conv_layer: MoELayer | None,
                         ref_layer: MoELayer | None, rep: LayerReport) -> LayerForward | None:
    """The numerics check of one layer: the converted weights' output vs the reference's (``rep``
    gets the comparison, the threshold and the verdict). None where nothing ran."""
    if (ref_layer is None and state.saved is None and state.plan.kernel is None) or (canon is None and conv_layer is None):
        rep.numerics = "skipped" if rep.layout != "FAIL" else "not run"
        return None
    x = hidden_states(state.plan.tokens, state.plan.info.hidden_size, state.plan.seed, L, state.plan.device)
    try:
        router = _router(state.plan.ckpts[0], lay)
    except BadInput as exc:
        rep.problems.append(str(exc))
        return None
    if canon is not None:
        conv_fn = expert_fn(canonical_stack(canon, "w13"), canonical_stack(canon, "w2"), canon.w13_bias, canon.w2_bias, state.plan.device)
        row_order = canon.row_order
    else:
        assert conv_layer is not None
        conv_fn = expert_fn(_weights(conv_layer, "w13"), _weights(conv_layer, "w2"), conv_layer.w13_bias, conv_layer.w2_bias, state.plan.device)
        row_order = conv_layer.row_order
    out, routing = run_layer(state.plan.info, row_order, conv_fn, router, x)
    if state.saved is not None:
        ref_out, ref_ids, ref_src_fmt = _saved_outputs(state, L)
    elif ref_layer is not None:
        ref_out, ref_ids, ref_src_fmt = _reference_outputs(state, L, lay, ref_layer, x)
    else:
        return LayerForward(x, routing, out, None)
    exact_fp8 = rep.fp8_tiles is not None and rep.fp8_tiles["inexact"] == 0  # every tile bit-equal to the MXFP4 reference
    ref_fmt = "exact" if _same_mx_bytes(ref_src_fmt, state.plan.weight_format) or exact_fp8 else state.plan.weight_format
    cmp = compare(out, ref_out, routing.ids, ref_ids)
    th = THRESHOLDS[ref_fmt]
    rep.comparison, rep.threshold = cmp, ref_fmt
    bad = [b for b in (_output_nonfinite(out, "converted output"), _output_nonfinite(ref_out, "reference output")) if b]
    if not cmp.rel_rms <= th["rel_rms"]:
        bad.append("relative RMS error {} > {}".format(*apart(cmp.rel_rms, th["rel_rms"])))
    if not cmp.cosine >= th["cosine"]:
        bad.append("cosine {} < {}".format(*apart(cmp.cosine, th["cosine"])))
    if not cmp.topk_agreement >= th["topk_agreement"]:
        bad.append("top-k agreement {} < {}".format(*apart(cmp.topk_agreement, th["topk_agreement"])))
    rep.numerics = "FAIL" if bad else "ok"
    rep.problems.extend(f"layer {L} numerics: {b}" for b in bad)
    return LayerForward(x, routing, out, (ref_out, ref_ids, th))


def _saved_outputs(state: VerifyState, L: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Layer ``L``'s output, top-k ids and source weight format from ``--reference-outputs``."""
    saved = state.saved
    assert saved is not None
    try:
        ref_out, ref_ids = saved[f"layer.{L}.output"], saved[f"layer.{L}.topk_ids"]
    except KeyError:
        saved_layers = sorted({int(n.split(".")[1]) for n in saved if n.endswith(".output")})
        raise BadInput(
            f"VerifyOptions.reference_outputs {state.plan.options.reference_outputs}: no outputs for layer {L} (the file holds layers "
            f"{saved_layers}; pass VerifyOptions.layers {','.join(map(str, saved_layers))})"
        ) from None
    code = int(saved[f"layer.{L}.format"].item()) if f"layer.{L}.format" in saved else 0
    return ref_out, ref_ids, _FORMAT_CODES[code]


def _reference_outputs(state: VerifyState, L: int, lay: LayerEntry, ref_layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Layer ``L``'s output, top-k ids and weight format computed from ``--reference`` (kept for
    ``--save-reference``)."""
    assert state.ref_ckpt is not None
    rfn = expert_fn(_weights(ref_layer, "w13"), _weights(ref_layer, "w2"), ref_layer.w13_bias, ref_layer.w2_bias, state.plan.device)
    ref_out, ref_routing = run_layer(state.plan.info, ref_layer.row_order, rfn, _router(state.ref_ckpt, lay), x)
    ref_src_fmt = ref_layer.w13_mx.fmt if ref_layer.w13_mx is not None else "int4" if ref_layer.w13_int4 is not None else "float"
    if state.plan.options.save_reference:
        state.to_save[f"layer.{L}.output"] = ref_out.contiguous()
        state.to_save[f"layer.{L}.topk_ids"] = ref_routing.ids.contiguous()
        state.to_save[f"layer.{L}.format"] = torch.tensor([_FORMAT_CODES.index(ref_src_fmt)], dtype=torch.uint8)
    return ref_out, ref_routing.ids, ref_src_fmt


def save_reference_outputs(path: Path, tensors: dict[str, torch.Tensor], seed: int, tokens: int) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"mxconv": "reference-outputs", "seed": str(seed), "tokens": str(tokens)})


def load_reference_outputs(path: Path, seed: int, tokens: int) -> dict[str, torch.Tensor]:
    from mxconv.source.st_format import read_header

    infos, meta = read_header(path)
    if meta.get("mxconv") != "reference-outputs":
        raise BadInput(f"{path}: not an mxconv reference-outputs file")
    if meta.get("seed") != str(seed) or meta.get("tokens") != str(tokens):
        raise BadInput(
            f"{path}: saved with VerifyOptions.seed {meta.get('seed')} VerifyOptions.tokens {meta.get('tokens')}; "
            f"run verify with the same values (got VerifyOptions.seed {seed} VerifyOptions.tokens {tokens})"
        )
    return {n: read_tensor(i) for n, i in infos.items()}
