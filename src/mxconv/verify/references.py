"""What a verify run compares the output with, opened before the layers are checked: the reference
(``VerifyOptions.reference``) or the outputs saved from one (``reference_outputs``), and a canonical
output read back by its own family reader; then the manifest's model claims held against them."""

from __future__ import annotations

from pathlib import Path

from mxconv.errors import BadInput
from mxconv.families import detect_family
from mxconv.source.checkpoint import open_checkpoint
from mxconv.verify.claims import check_model_claims, reference_mismatch, reference_source_claims
from mxconv.verify.exact import start_copies
from mxconv.verify.integrity import MODEL_FIELDS, check_manifest_claims
from mxconv.verify.linears import quantized_linear_tensors
from mxconv.verify.numerics import load_reference_outputs
from mxconv.verify.state import VerifyState


def open_references(state: VerifyState) -> list[str]:
    """Open what the plan compares with (filling ``state``), and the problems that shows: the output
    not reading back as its family, the manifest's model claims the output or the reference
    contradicts (then ``state.model_broken``: the numerics would run on a model the output is not)."""
    plan, general = state.plan, []
    _read_back(state, general)
    claims: list[str] = []
    if plan.options.reference:
        claims += _open_reference(state, plan.options.reference)
        start_copies(state, quantized_linear_tensors(state))
    if plan.options.reference_outputs:
        _load_saved(state, plan.options.reference_outputs)
    own_reader = state.own_reader if state.own_error is None else None  # a canonical output that reads back
    ckpts = list(plan.ckpts)
    if state.own_error is None:
        claims += check_manifest_claims(plan.manifest, plan.info, ckpts, own_reader)
    claims += check_model_claims(plan.manifest, plan.info, ckpts, own_reader)
    state.model_broken = bool(claims)
    return general + claims


def _read_back(state: VerifyState, general: list[str]) -> None:
    """A canonical output read by its own family reader; a damaged one (a tensor missing, a config
    edited) fails verification, naming why."""
    plan = state.plan
    if plan.kind != "canonical":
        return
    try:
        state.own_reader = detect_family(plan.ckpts[0])
        state.own_refs = {r.layer: r for r in state.own_reader.layer_refs()}
    except BadInput as exc:
        state.own_error = str(exc)
        general.append(f"{plan.root}: does not read back as a {plan.manifest.family} checkpoint: {exc}")


def _open_reference(state: VerifyState, reference: str) -> list[str]:
    """Open the reference: BadInput (exit 2) when its tensors are not the output's shapes (a different
    model); otherwise the manifest's model fields it contradicts, the output's damage (exit 1)."""
    plan = state.plan
    state.ref_ckpt = ref_ckpt = open_checkpoint(reference, plan.options.revision)
    state.ref_reader = ref_reader = detect_family(ref_ckpt)
    state.ref_info = rinfo = ref_reader.model_info()
    own = state.own_reader.model_info() if state.own_reader is not None and state.own_error is None else None
    mismatch = reference_mismatch(plan.manifest, list(plan.ckpts), own, rinfo, ref_ckpt)
    if mismatch:
        raise BadInput(f"VerifyOptions.reference {reference}: a different model ({mismatch}; the output is {plan.root}); "
                       "pass the checkpoint this one was converted from")
    return [f"manifest model.{f} is {getattr(plan.info, f)!r}, but the reference {reference}, whose tensors have this "
            f"output's shapes, gives {getattr(rinfo, f)!r}" for f in MODEL_FIELDS if getattr(rinfo, f) != getattr(plan.info, f)
            ] + reference_source_claims(plan.manifest, plan.info, ref_reader, ref_ckpt, reference)


def _load_saved(state: VerifyState, reference_outputs: str) -> None:
    plan = state.plan
    state.saved = load_reference_outputs(Path(reference_outputs), plan.seed, plan.tokens)
    for name, t in state.saved.items():
        if name.endswith(".output") and tuple(t.shape) != (plan.tokens, plan.info.hidden_size):
            raise BadInput(
                f"VerifyOptions.reference_outputs {reference_outputs}: {name} has shape {list(t.shape)}, expected "
                f"[{plan.tokens}, {plan.info.hidden_size}] (outputs of a different model?)"
            )
