"""``mxconv verify``: integrity, layout and numerics of a converted checkpoint.

1. Integrity (:mod:`.integrity`) — every tensor the manifest lists exists with its shape, dtype and
   sha256; no unlisted tensors; every shard the index names exists (header validation included).
   Damage that keeps the output from reading at all (a malformed manifest, shards and index that
   disagree, a bad header) fails here too, naming file, tensor and rule: exit 1, not 2. The
   manifest's model and layout claims hold against config.json, the tensor shapes and, with
   ``--reference``, the reference's model (:mod:`.claims`).
2. Layout (:mod:`.layout`) — kernel-layout tensors are inverted with the backend's inverse (padding
   must hold its fill), re-laid-out and compared byte for byte with what is stored. With
   ``--reference`` (:mod:`.exact`) the recovered canonical bytes must be the reference's own (same
   format) or the reference converted again with the recorded options, byte for byte, and every
   tensor the output copied must be the reference's; where the bytes cannot be re-derived, the
   scope says so.
3. Numerics (:mod:`.numerics`) — seeded hidden states through router + experts of the converted
   weights vs the reference (a source checkpoint or outputs saved earlier), with per-format
   thresholds. A value that is not a number fails, never passes: an E8M0 scale byte 0xFF, a NaN/Inf
   bias or router (converted or reference, named by tensor and index), or a non-finite layer output.
   They do not run on a manifest whose model claims do not hold.

:func:`verify` orchestrates them: each check fills its part of a :class:`LayerReport` (or the
report's general problems); :class:`VerifyReport` is the result, and its :class:`Scope` says which
checks ran and why the others did not (numerics need a reference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from mxconv.engines.runner import KERNEL_THRESHOLDS
from mxconv.environment import KernelLocations
from mxconv.source.checkpoint import open_checkpoint
from mxconv.source.file_names import rank_dir_name, rank_dirs
from mxconv.errors import BadInput, Unsupported
from mxconv.interrupt import next_step
from mxconv.families import detect_family
from mxconv.layouts import backend_names
from mxconv.source.manifest import LayerEntry, Manifest, check_own_paths, complete_output_dir, load_manifest
from mxconv.verify.hashing import TensorHashes
from mxconv.verify.claims import check_model_claims, reference_mismatch, reference_source_claims
from mxconv.verify.exact import check_expert_bytes, copies_differ, refused_summary, start_copies
from mxconv.verify.integrity import MODEL_FIELDS, check_integrity, check_manifest_claims, model_info_of
from mxconv.verify.layout import recover_layer, reference_layer
from mxconv.verify.prefetch import LayerBytes, LayerReads
from mxconv.verify.fp8_block import check_fp8_tiles
from mxconv.verify.linears import LINEAR_THRESHOLDS, check_linears, quantized_linear_tensors
from mxconv.verify.numerics import (
    check_layer_numerics, converted_nonfinite, load_reference_outputs, save_reference_outputs,
)
from mxconv.verify.report import LayerReport, Run, Scope, VerifyReport
from mxconv.verify.kernel import KernelResult, check_kernel_layer, kernel_preflight

__all__ = ["parse_layers", "verify"]


def parse_layers(spec: str | None, available: list[int]) -> list[int]:
    if not spec:
        return available
    try:
        want = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise BadInput(f"--layers {spec!r}: expected comma-separated layer numbers, e.g. 0,3") from None
    if not want:
        raise BadInput(f"--layers {spec!r}: names no layer (available: {available})")
    missing = [w for w in want if w not in available]
    if missing:
        raise BadInput(f"--layers: {missing} are not converted MoE layers (available: {available})")
    return want


def verify(
    path: str | Path,
    *,
    reference: str | None = None,
    reference_outputs: str | None = None,
    save_reference: str | None = None,
    layers: str | None = None,
    tokens: int = 64,
    seed: int = 0,
    revision: str | None = None,
    kernel: bool = False,
    kernel_locations: KernelLocations | None = None,
    strict: bool = False,
    device: torch.device | str = "cpu",
    on_step: Callable[[str, int, int], None] | None = None,
) -> VerifyReport:
    """Run the three checks on ``path``; see the module docstring. ``on_step(what, done, total)`` is
    called before each long step (the integrity hashes, then each checked layer) and once at the end.
    The report's scope says what ran; ``strict`` fails the run when numerics could not (no reference).
    Damage to ``path``'s own files fails verification (:func:`_unreadable`); bad options, a bad
    reference and an output this mxconv cannot read raise BadInput."""
    next_step()  # a signal noted after an earlier output of this command was complete stops it here
    step = on_step or (lambda what, done, total: None)
    root = _output_dir(path, tokens, reference, reference_outputs, save_reference)
    manifest = None
    try:
        manifest = load_manifest(root)
        run = _open_run(root, manifest, reference, reference_outputs, save_reference, tokens, seed, device)
    except Unsupported:
        raise
    except BadInput as exc:  # the output's manifest, index, shards or config are damaged or disagree
        return _unreadable(root, manifest, exc)
    lay_table = {entry.layer: entry for entry in run.manifest.layers}
    chosen = sorted(set(parse_layers(layers, sorted(lay_table))))
    steps = len(chosen) + 1
    step("integrity (files, headers)", 0, steps)
    integ, expected = check_integrity(run.root, run.manifest, run.ckpts)
    with TensorHashes(expected) as run.hashes:
        return _verify_layers(run, kernel, kernel_locations, reference, reference_outputs, revision, layers, strict,
                              lay_table, chosen, integ, step)


def _verify_layers(run: Run, kernel: bool, kernel_locations: KernelLocations | None, reference: str | None,
                   reference_outputs: str | None, revision: str | None, layers: str | None, strict: bool,
                   lay_table: dict[int, LayerEntry], chosen: list[int], integ: dict[int | None, list[str]],
                   step: Callable[[str, int, int], None]) -> VerifyReport:
    """The checks after the headers: layers (their bytes hashed as they are read; the other tensors
    hashed on the pool meanwhile), then the hash verdicts, the linears and the report."""
    steps = len(chosen) + 1
    if run.kind == "kernel":  # the layout check reads the chosen layers' expert tensors: hashed from memory
        run.hashes.start_rest(_expert_keys(run, [lay_table[L] for L in chosen]))
    else:
        run.hashes.start_rest(set())
    if kernel:
        run.kernel_locations = kernel_locations
        run.klayout, run.kernel_size_problems = kernel_preflight(run.manifest, kernel_locations)
    general: list[str] = list(integ.get(None, []))
    _read_back(run, general)
    claims: list[str] = []  # what the manifest says about the model that the output (or the reference) contradicts
    if reference:
        claims += _open_reference(run, reference, revision)
        start_copies(run, quantized_linear_tensors(run))
    if reference_outputs:
        _load_saved(run, reference_outputs)
    own_reader = run.own_reader if run.own_error is None else None  # a canonical output that reads back
    if run.own_error is None:
        claims += check_manifest_claims(run.manifest, run.info, run.ckpts, own_reader)
    claims += check_model_claims(run.manifest, run.info, run.ckpts, own_reader)
    run.model_broken = bool(claims)  # the numerics would run on a model the output is not
    general += claims
    reports: dict[int, LayerReport] = {}
    with LayerReads(run, {L: lay_table[L].module_prefix for L in chosen}) as reads:
        for i, L in enumerate(chosen):
            step(f"layer {L}", 1 + i, steps)
            reports[L] = LayerReport(L)
            layer_bytes = reads.get(L, chosen[i + 1:])
            for ckpt, name, digest in layer_bytes.digests:
                run.hashes.record(ckpt, name, digest)
            _check_layer(run, L, lay_table[L], reports[L], layer_bytes)
            del layer_bytes
    for where, probs in _merged({k: v for k, v in integ.items() if k is not None}, run.hashes.problems()).items():
        if where is None:
            general.extend(probs)
            continue
        rep = reports.setdefault(where, LayerReport(where))
        rep.integrity = "FAIL"
        rep.problems[:0] = probs
    linears, lin_problems = check_linears(run, set(chosen) if layers else None)
    general.extend(lin_problems)
    general.extend(copies_differ(run))
    notes = _finish(run)
    step("done", steps, steps)
    if linears:
        notes.append(f"{len(linears)} MXFP8 linear layers checked" + (
            f" against the reference (relative RMS <= {LINEAR_THRESHOLDS['rel_rms']}, bytes = the reference quantized again)"
            if run.ref_ckpt is not None else " (files and config; numerics need --reference)"))
    scope = _scope(run, chosen if layers else None)
    if strict and "numerics" in scope.not_checked:
        general.append(f"--strict: numerics not checked ({scope.not_checked['numerics']}); pass --reference SOURCE "
                       "(the checkpoint this one was converted from) or --reference-outputs FILE")
    if strict and "bytes" in scope.not_checked:  # a reference was given, but the experts' bytes were not held to it
        general.append(f"--strict: expert bytes not re-derived ({scope.not_checked['bytes']}); a PASS would rest on "
                       "the numerics' tolerance alone")
    return VerifyReport(str(run.root), run.kind, run.manifest.backend, [reports[L] for L in sorted(reports)],
                        general, notes, linears, scope)


def _merged(*by_layer: dict[int | None, list[str]]) -> dict[int | None, list[str]]:
    """Problem lists by layer, concatenated in argument order (empty lists dropped)."""
    out: dict[int | None, list[str]] = {}
    for d in by_layer:
        for where, probs in d.items():
            if probs:
                out.setdefault(where, []).extend(probs)
    return out


def _expert_keys(run: Run, lays: list[LayerEntry]) -> set[str]:
    """Manifest keys of the expert tensors the layout check reads (and hands to the hasher)."""
    tp = len(run.ckpts)
    keys = set()
    for lay in lays:
        for r, ckpt in enumerate(run.ckpts):
            for name in ckpt.tensors:
                if name.startswith(f"{lay.module_prefix}.experts."):
                    keys.add(name if tp == 1 else f"{rank_dir_name(r)}/{name}")
    return keys


NO_REFERENCE = "no --reference or --reference-outputs given"
MODEL_BROKEN = "they would run on the manifest's model, which the output contradicts (FAIL lines)"


def _scope(run: Run, layers: list[int] | None) -> Scope:
    """What this run checked: integrity and layout always; with ``--reference`` the bytes (or why the
    experts' could not be re-derived); numerics against a reference when one was given and the
    manifest's model holds; the engine kernel with ``--kernel``."""
    scope = Scope(["integrity", "layout"], layers=layers)
    if run.ref_reader is not None:
        refused = refused_summary(run, layers or run.manifest.layer_numbers)
        scope.bytes_against = run.reference
        if refused is None:
            scope.checked.append("bytes")
        else:
            scope.not_checked["bytes"] = refused
    if run.model_broken:
        scope.not_checked["numerics"] = MODEL_BROKEN
    elif run.ref_reader is not None or run.saved is not None:
        scope.checked.append("numerics")
        scope.numerics_against = run.reference or f"saved outputs {run.reference_outputs}"
    else:
        scope.not_checked["numerics"] = NO_REFERENCE
    if run.klayout is not None:
        scope.checked.append("kernel")
        scope.kernel = run.manifest.backend
    return scope


def _unreadable(root: Path, manifest: Manifest | None, exc: BadInput) -> VerifyReport:
    """The report of an output whose own files do not read as a whole: a malformed manifest, a shard
    the index names missing, a tensor the index maps to a shard that lacks it (or one in a shard the
    index does not name), a damaged shard header or config. A failed verification (exit 1) naming
    the file, tensor and rule, not bad usage: the directory claims to be a complete output."""
    why = "the output's own files do not read as a checkpoint"
    scope = Scope(["integrity"], {"layout": why, "numerics": why})
    kind = manifest.kind if manifest is not None else "unknown"
    return VerifyReport(str(root), kind, manifest.backend if manifest is not None else None, [], [str(exc)], [], scope=scope)


def _output_dir(path: str | Path, tokens: int, reference: str | None, reference_outputs: str | None,
                save_reference: str | None) -> Path:
    """The directory to verify, after the options: BadInput (exit 2) for bad usage, a path that is no
    directory, or a directory that is no complete mxconv output (no mxconv.json: not one, still being
    written, or left by an interrupted run)."""
    if tokens < 1:
        raise BadInput("--tokens must be >= 1")
    if reference and reference_outputs:
        raise BadInput("give either --reference or --reference-outputs, not both")
    if save_reference and not reference:
        raise BadInput("--save-reference needs --reference (the outputs saved are the reference's)")
    return complete_output_dir(path)


def _open_run(root: Path, manifest: Manifest, reference: str | None, reference_outputs: str | None, save_reference: str | None,
              tokens: int, seed: int, device: torch.device | str) -> Run:
    """The output (every TP rank) and its manifest, checked against each other."""
    if manifest.is_kernel and manifest.backend not in backend_names():  # a plug-in not registered here
        raise Unsupported(f"{root / 'mxconv.json'}: backend {manifest.backend!r} is not one this mxconv knows "
                          f"({', '.join(backend_names())}); a newer mxconv, or a plug-in backend not registered in this process?")
    tp = manifest.tp_size
    check_own_paths(root, manifest)  # a linked rank directory or shard: damage, before anything is read through it
    dirs = rank_dirs(root, tp)
    for d in dirs:
        if not d.is_dir():
            raise BadInput(f"{d}: missing (manifest says tp_size {tp})")
    ckpts = [open_checkpoint(d) for d in dirs]
    return Run(root, manifest, ckpts, model_info_of(manifest.model), tokens, seed, device,
               reference=reference, reference_outputs=reference_outputs, save_reference=save_reference)


def _open_reference(run: Run, reference: str, revision: str | None) -> list[str]:
    """Open ``--reference``: BadInput (exit 2) when its tensors are not the output's shapes (a different
    model); otherwise the manifest's model fields it contradicts, the output's damage (exit 1)."""
    run.ref_ckpt = open_checkpoint(reference, revision)
    run.ref_reader = detect_family(run.ref_ckpt)
    run.ref_info = rinfo = run.ref_reader.model_info()
    own = run.own_reader.model_info() if run.own_reader is not None and run.own_error is None else None
    mismatch = reference_mismatch(run.manifest, run.ckpts, own, rinfo, run.ref_ckpt)
    if mismatch:
        raise BadInput(f"--reference {reference}: a different model ({mismatch}; the output is {run.root}); "
                       "pass the checkpoint this one was converted from")
    return [f"manifest model.{f} is {getattr(run.info, f)!r}, but the reference {reference}, whose tensors have this "
            f"output's shapes, gives {getattr(rinfo, f)!r}" for f in MODEL_FIELDS if getattr(rinfo, f) != getattr(run.info, f)
            ] + reference_source_claims(run.manifest, run.info, run.ref_reader, run.ref_ckpt, reference)


def _load_saved(run: Run, reference_outputs: str) -> None:
    run.saved = load_reference_outputs(Path(reference_outputs), run.seed, run.tokens)
    for name, t in run.saved.items():
        if name.endswith(".output") and tuple(t.shape) != (run.tokens, run.info.hidden_size):
            raise BadInput(
                f"--reference-outputs {reference_outputs}: {name} has shape {list(t.shape)}, expected "
                f"[{run.tokens}, {run.info.hidden_size}] (outputs of a different model?)"
            )


def _read_back(run: Run, general: list[str]) -> None:
    """A canonical output read by its own family reader; a damaged one (a tensor missing, a config
    edited) fails verification, naming why."""
    if run.kind != "canonical":
        return
    try:
        run.own_reader = detect_family(run.ckpts[0])
        run.own_refs = {r.layer: r for r in run.own_reader.layer_refs()}
    except BadInput as exc:
        run.own_error = str(exc)
        general.append(f"{run.root}: does not read back as a {run.manifest.family} checkpoint: {exc}")


def _check_layer(run: Run, L: int, lay: LayerEntry, rep: LayerReport, read: LayerBytes) -> None:
    """Layout, values that are not numbers, numerics and (``--kernel``) the engine kernel of one MoE
    layer, from its bytes as read."""
    canon, conv_layer = recover_layer(run, L, lay, rep, read.kernel)
    bad_value = converted_nonfinite(run, lay, canon, conv_layer)
    if bad_value:
        rep.problems.append(f"layer {L}: {bad_value}")
    ref_layer = None
    if run.ref_reader is not None:
        ref_layer, ref_bad = reference_layer(run, L, rep, read.reference)
        bad_value = bad_value or ref_bad
        if not bad_value:
            check_expert_bytes(run, L, lay.module_prefix, canon, conv_layer, ref_layer, rep)
            if conv_layer is not None:
                check_fp8_tiles(run.manifest, L, ref_layer, conv_layer, rep)
    if bad_value:
        rep.numerics = "FAIL"
        return
    if run.model_broken:
        rep.numerics = "not run"
        return
    fwd = check_layer_numerics(run, L, lay, canon, conv_layer, ref_layer, rep)
    if fwd is None or run.klayout is None:
        return
    if run.kernel_size_problems:
        rep.kernel = KernelResult("FAIL", problems=[f"layer {L} kernel: {p}" for p in run.kernel_size_problems])
    else:
        rep.kernel = check_kernel_layer(run.klayout, run.root, run.manifest, L, fwd.x, fwd.routing, fwd.out, fwd.reference,
                                        run.kernel_locations, read.held())
    rep.problems.extend(rep.kernel.problems)


def _finish(run: Run) -> list[str]:
    """Save the reference outputs (``--save-reference``); the report's notes."""
    notes: list[str] = []
    if run.save_reference:
        save_reference_outputs(Path(run.save_reference), run.to_save, run.seed, run.tokens)
        notes.append(f"reference outputs saved to {run.save_reference}")
    if run.klayout is not None and not run.kernel_size_problems:
        notes.append(f"--kernel: the {run.manifest.backend} engine kernel ran on every checked layer "
                     f"(bound vs the converted bytes: relative RMS <= {KERNEL_THRESHOLDS['rel_rms']}, cosine >= "
                     f"{KERNEL_THRESHOLDS['cosine']})")
    return notes
