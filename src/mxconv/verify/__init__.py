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

:func:`verify` runs them as a pipeline like a conversion's (:mod:`mxconv.run`): typed, frozen
:class:`VerifyOptions` (:mod:`.options`), a frozen :class:`VerifyPlan` made from the manifest, the
headers and the options before any tensor is read (:mod:`.plan`), the checks in order
(:mod:`.pipeline`, their shared :class:`~mxconv.verify.state.VerifyState`), and a typed
:class:`VerifyReport` (:mod:`.report`): each check fills its part of a :class:`LayerReport` (or the
report's general problems), and its :class:`Scope` says which checks ran and why the others did not
(numerics need a reference).
"""

from __future__ import annotations

from pathlib import Path

from mxconv.verify.options import VerifyOptions
from mxconv.verify.pipeline import StepFn, verify_output
from mxconv.verify.plan import VerifyPlan
from mxconv.verify.report import LayerReport, Scope, VerifyReport

__all__ = ["LayerReport", "Scope", "VerifyOptions", "VerifyPlan", "VerifyReport", "verify"]


def verify(path: str | Path, options: VerifyOptions | None = None, on_step: StepFn | None = None) -> VerifyReport:
    """Verify the mxconv output at ``path`` with ``options`` (default: integrity and layout only; a
    ``VerifyOptions(reference=...)`` adds the bytes and numerics). ``on_step(what, done, total)`` is
    called before each long step (the integrity hashes, then each checked layer) and once at the end.
    The report's scope says what ran; ``VerifyOptions.strict`` fails the run when numerics could not
    (no reference). Damage to ``path``'s own files fails verification; bad options, a bad reference
    and an output this mxconv cannot read raise BadInput."""
    return verify_output(path, options or VerifyOptions(), on_step)
