"""A verify run, phase by phase: open the output (its damage is a failed verification), plan from the
manifest, headers and options (:class:`~mxconv.verify.plan.VerifyPlan`, nothing read yet), check
the headers, open the references, check each chosen layer as its bytes are read (the other tensors
hashed on threads meanwhile), then the hash verdicts, the linears and the copies, and report
(:class:`~mxconv.verify.report.VerifyReport`: what held, what did not, and the scope of it)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from mxconv.engines.runner import KERNEL_THRESHOLDS
from mxconv.errors import BadInput, Unsupported
from mxconv.interrupt import next_step
from mxconv.source.file_names import rank_dir_name
from mxconv.source.manifest import LayerEntry, Manifest, complete_output_dir, load_manifest
from mxconv.verify.exact import check_expert_bytes, copies_differ, refused_summary
from mxconv.verify.fp8_block import check_fp8_tiles
from mxconv.verify.hashing import TensorHashes
from mxconv.verify.integrity import check_integrity
from mxconv.verify.kernel import KernelResult, check_kernel_layer
from mxconv.verify.layout import recover_layer, reference_layer
from mxconv.verify.linears import LINEAR_THRESHOLDS, LinearReport, check_linears
from mxconv.verify.numerics import check_layer_numerics, converted_nonfinite, save_reference_outputs
from mxconv.verify.options import VerifyOptions
from mxconv.verify.plan import VerifyPlan, open_output
from mxconv.verify.prefetch import LayerBytes, LayerReads
from mxconv.verify.references import open_references
from mxconv.verify.report import LayerReport, Scope, VerifyReport
from mxconv.verify.state import VerifyState

StepFn = Callable[[str, int, int], None]  # (what, done, total): called before each long step

NO_REFERENCE = "no VerifyOptions.reference or VerifyOptions.reference_outputs given"
MODEL_BROKEN = "they would run on the manifest's model, which the output contradicts (FAIL lines)"


def verify_output(path: str | Path, options: VerifyOptions, on_step: StepFn | None = None) -> VerifyReport:
    """Verify the output at ``path`` as ``options`` say (see :mod:`mxconv.verify`). Damage to its own
    files fails verification (:func:`_unreadable`); a directory that is no complete mxconv output,
    layers it has not, a bad reference or a kernel that cannot run here raise BadInput."""
    next_step()  # a signal noted after an earlier output of this command was complete stops it here
    step = on_step or (lambda what, done, total: None)
    root = complete_output_dir(path)
    manifest = None
    try:
        manifest = load_manifest(root)
        ckpts = open_output(root, manifest)
    except Unsupported:
        raise
    except BadInput as exc:  # the output's manifest, index, shards or config are damaged or disagree
        return _unreadable(root, manifest, exc)
    plan = VerifyPlan.build(root, manifest, ckpts, options)
    step("integrity (files, headers)", 0, len(plan.layers) + 1)
    integrity, expected = check_integrity(root, manifest, list(ckpts))
    with TensorHashes(expected) as hashes:
        return _checks(VerifyState(plan, hashes), integrity, step)


def _checks(state: VerifyState, integrity: dict[int | None, list[str]], step: StepFn) -> VerifyReport:
    """The checks after the headers: layers (their bytes hashed as they are read; the other tensors
    hashed on the pool meanwhile), then the hash verdicts, the linears and the report."""
    plan, hashes = state.plan, state.hashes
    assert hashes is not None
    steps = len(plan.layers) + 1
    # a kernel output's layout check reads the chosen layers' expert tensors: hashed from memory
    hashes.start_rest(_expert_keys(plan) if plan.kind == "kernel" else set())
    general: list[str] = list(integrity.get(None, []))
    general += open_references(state)
    reports = _check_layers(state, step)
    layer_problems = {k: v for k, v in integrity.items() if k is not None}
    for where, probs in _merged(layer_problems, hashes.problems()).items():
        if where is None:
            general.extend(probs)
            continue
        rep = reports.setdefault(where, LayerReport(where))
        rep.integrity = "FAIL"
        rep.problems[:0] = probs
    linears, lin_problems = check_linears(state, set(plan.layers) if plan.options.layers else None)
    general.extend(lin_problems)
    general.extend(copies_differ(state))
    notes = _finish(state, linears)
    step("done", steps, steps)
    scope = _scope(state)
    general.extend(_strict_problems(plan.options, scope))
    return VerifyReport(str(plan.root), plan.kind, plan.manifest.backend, [reports[L] for L in sorted(reports)],
                        general, notes, linears, scope)


def _check_layers(state: VerifyState, step: StepFn) -> dict[int, LayerReport]:
    """Every chosen layer, read (one ahead on a GPU) and checked; its digests handed to the hasher."""
    plan, hashes = state.plan, state.hashes
    assert hashes is not None
    entries, chosen = plan.entries, list(plan.layers)
    reports: dict[int, LayerReport] = {}
    with LayerReads(state, {L: entries[L].module_prefix for L in chosen}) as reads:
        for i, L in enumerate(chosen):
            step(f"layer {L}", 1 + i, len(chosen) + 1)
            reports[L] = LayerReport(L)
            layer_bytes = reads.get(L, chosen[i + 1:])
            for ckpt, name, digest in layer_bytes.digests:
                hashes.record(ckpt, name, digest)
            _check_layer(state, entries[L], reports[L], layer_bytes)
            del layer_bytes
    return reports


def _check_layer(state: VerifyState, lay: LayerEntry, rep: LayerReport, read: LayerBytes) -> None:
    """Layout, values that are not numbers, numerics and (``VerifyOptions.kernel``) the engine kernel
    of one MoE layer, from its bytes as read."""
    plan, L = state.plan, lay.layer
    canon, conv_layer = recover_layer(state, L, lay, rep, read.kernel)
    bad_value = converted_nonfinite(state, lay, canon, conv_layer)
    if bad_value:
        rep.problems.append(f"layer {L}: {bad_value}")
    ref_layer = None
    if state.ref_reader is not None:
        ref_layer, ref_bad = reference_layer(state, L, rep, read.reference)
        bad_value = bad_value or ref_bad
        if not bad_value:
            check_expert_bytes(state, L, lay.module_prefix, canon, conv_layer, ref_layer, rep)
            if conv_layer is not None:
                check_fp8_tiles(plan.manifest, L, ref_layer, conv_layer, rep)
    if bad_value:
        rep.numerics = "FAIL"
        return
    if state.model_broken:
        rep.numerics = "not run"
        return
    fwd = check_layer_numerics(state, L, lay, canon, conv_layer, ref_layer, rep)
    if fwd is None or plan.kernel is None:
        return
    if plan.kernel.size_problems:
        rep.kernel = KernelResult("FAIL", problems=[f"layer {L} kernel: {p}" for p in plan.kernel.size_problems])
    else:
        rep.kernel = check_kernel_layer(plan.root, plan.manifest, L, fwd, plan.options.kernel_locations, read.held())
    rep.problems.extend(rep.kernel.problems)


def _merged(*by_layer: dict[int | None, list[str]]) -> dict[int | None, list[str]]:
    """Problem lists by layer, concatenated in argument order (empty lists dropped)."""
    out: dict[int | None, list[str]] = {}
    for d in by_layer:
        for where, probs in d.items():
            if probs:
                out.setdefault(where, []).extend(probs)
    return out


def _expert_keys(plan: VerifyPlan) -> set[str]:
    """Manifest keys of the expert tensors the layout check reads (and hands to the hasher)."""
    tp = len(plan.ckpts)
    keys = set()
    for lay in plan.entries.values():
        for r, ckpt in enumerate(plan.ckpts):
            for name in ckpt.tensors:
                if name.startswith(f"{lay.module_prefix}.experts."):
                    keys.add(name if tp == 1 else f"{rank_dir_name(r)}/{name}")
    return keys


def _scope(state: VerifyState) -> Scope:
    """What this run checked: integrity and layout always; with a reference the bytes (or why the
    experts' could not be re-derived); numerics against a reference when one was given and the
    manifest's model holds; the engine kernel with ``VerifyOptions.kernel``."""
    plan, options = state.plan, state.plan.options
    scope = Scope(["integrity", "layout"], layers=plan.limited)
    if state.ref_reader is not None:
        refused = refused_summary(state, plan.limited or plan.manifest.layer_numbers)
        scope.bytes_against = options.reference
        if refused is None:
            scope.checked.append("bytes")
        else:
            scope.not_checked["bytes"] = refused
    if state.model_broken:
        scope.not_checked["numerics"] = MODEL_BROKEN
    elif state.ref_reader is not None or state.saved is not None:
        scope.checked.append("numerics")
        scope.numerics_against = options.reference or f"saved outputs {options.reference_outputs}"
    else:
        scope.not_checked["numerics"] = NO_REFERENCE
    if plan.kernel is not None:
        scope.checked.append("kernel")
        scope.kernel = plan.manifest.backend
    return scope


def _strict_problems(options: VerifyOptions, scope: Scope) -> list[str]:
    """``VerifyOptions.strict``: what the run did not check that a strict run requires."""
    if not options.strict:
        return []
    out = []
    if "numerics" in scope.not_checked:
        out.append(f"VerifyOptions.strict: numerics not checked ({scope.not_checked['numerics']}); VerifyOptions.reference "
                   "SOURCE (the checkpoint this one was converted from) or VerifyOptions.reference_outputs FILE checks them")
    if "bytes" in scope.not_checked:  # a reference was given, but the experts' bytes were not held to it
        out.append(f"VerifyOptions.strict: expert bytes not re-derived ({scope.not_checked['bytes']}); a PASS would rest on "
                   "the numerics' tolerance alone")
    return out


def _unreadable(root: Path, manifest: Manifest | None, exc: BadInput) -> VerifyReport:
    """The report of an output whose own files do not read as a whole: a malformed manifest, a shard
    the index names missing, a tensor the index maps to a shard that lacks it (or one in a shard the
    index does not name), a damaged shard header or config. A failed verification (exit 1) naming
    the file, tensor and rule, not bad usage: the directory claims to be a complete output."""
    why = "the output's own files do not read as a checkpoint"
    scope = Scope(["integrity"], {"layout": why, "numerics": why})
    kind = manifest.kind if manifest is not None else "unknown"
    return VerifyReport(str(root), kind, manifest.backend if manifest is not None else None, [], [str(exc)], [], scope=scope)


def _finish(state: VerifyState, linears: list[LinearReport]) -> list[str]:
    """Save the reference outputs (``VerifyOptions.save_reference``); the report's notes."""
    plan, options, notes = state.plan, state.plan.options, []
    if options.save_reference:
        save_reference_outputs(Path(options.save_reference), state.to_save, plan.seed, plan.tokens)
        notes.append(f"reference outputs saved to {options.save_reference}")
    if plan.kernel is not None and not plan.kernel.size_problems:
        notes.append(f"VerifyOptions.kernel: the {plan.manifest.backend} engine kernel ran on every checked layer "
                     f"(bound vs the converted bytes: relative RMS <= {KERNEL_THRESHOLDS['rel_rms']}, cosine >= "
                     f"{KERNEL_THRESHOLDS['cosine']})")
    if linears:
        notes.append(f"{len(linears)} MXFP8 linear layers checked" + (
            f" against the reference (relative RMS <= {LINEAR_THRESHOLDS['rel_rms']}, bytes = the reference quantized again)"
            if state.ref_ckpt is not None else " (files and config; numerics need VerifyOptions.reference)"))
    return notes
