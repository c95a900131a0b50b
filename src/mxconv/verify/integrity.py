"""verify, check 1 (integrity): every tensor the manifest lists is on disk with its file, shape,
dtype and sha256, nothing unlisted is there, and what the manifest claims about the model and the
layout is what the files hold."""

from __future__ import annotations

import json
from pathlib import Path

from mxconv.source.checkpoint import Checkpoint, layer_index
from mxconv.source.file_names import WEIGHT_FILE, rank_dir_name
from mxconv.source.manifest import Manifest, ModelPart, stored_problem
from mxconv.errors import BadInput
from mxconv.families.base import FamilyReader, ModelInfo
from mxconv.layouts import get_layout
from mxconv.verify.hashing import Expected
from mxconv.verify.layout import manifest_sizes


def check_integrity(root: Path, manifest: Manifest,
                    ckpts: list[Checkpoint]) -> tuple[dict[int | None, list[str]], list[Expected]]:
    """Problems by layer (None = not in a layer) that the headers show — a listed tensor missing, in
    another file, of another shape or dtype, an unlisted tensor or weight file — and the tensors
    whose sha256 is still to be checked (:class:`~mxconv.verify.hashing.TensorHashes`)."""
    problems: dict[int | None, list[str]] = {}
    expected: list[Expected] = []
    tp = len(ckpts)
    seen: set[str] = set()
    for key, entry in manifest.tensors.items():
        rank, name = 0, key
        if tp > 1:  # "rank-R/<name>", R < tp: load_manifest checked the key with the file name
            prefix, _, name = key.partition("/")
            rank = int(prefix.removeprefix("rank-"))
        ckpt = ckpts[rank]
        seen.add(key)
        problem = stored_problem(root, manifest, key, ckpt.tensors.get(name))
        if problem:
            problems.setdefault(layer_index(name), []).append(problem)
            continue
        expected.append(Expected(key, ckpt, name, entry.sha256))
    for r, ckpt in enumerate(ckpts):
        for name in ckpt.tensors:
            key = name if tp == 1 else f"{rank_dir_name(r)}/{name}"
            if key not in seen:
                problems.setdefault(layer_index(name), []).append(f"{key}: present in the checkpoint but not in the manifest")
        problems.setdefault(None, []).extend(stray_weight_files(root, ckpt.root, ckpt.shard_files))
    if tp > 1:  # the top of a TP output holds no weights at all
        problems.setdefault(None, []).extend(stray_weight_files(root, root, []))
    return problems, expected


def stray_weight_files(root: Path, directory: Path, shard_files: list[Path]) -> list[str]:
    """Weight files in ``directory`` that are not its indexed ``shard_files``: a loader may read one
    instead of the indexed shards (transformers takes ``model.safetensors`` first), so they fail
    verification."""
    shards = {f.name for f in shard_files}
    return [
        f"{f.relative_to(root).as_posix()}: a weight file the output's index does not name (a loader such as "
        "transformers may read it instead of the indexed shards); remove it"
        for f in sorted(directory.iterdir())
        if f.is_file() and WEIGHT_FILE.search(f.name) and f.name not in shards
    ]


# Manifest layout keys that convert sets itself (the others come from the backend's describe()).
_LAYOUT_KEYS_SET_BY_CONVERT = frozenset({"hidden_size", "intermediate_size", "intermediate_size_total", "padded_hidden_size",
                                         "padded_intermediate_size", "tp_ranges", "options", "w13_row_order", "kernel_params"})
# ModelInfo fields a canonical output's own config and tensors must repeat (not the formats: those
# of the output differ from the source's, which the manifest's model table describes).
MODEL_FIELDS = ("family", "num_layers", "moe_layers", "num_experts", "top_k", "hidden_size", "intermediate_size",
                 "row_order", "has_expert_bias", "routing", "norm_topk_prob", "n_group", "topk_group",
                 "routed_scaling_factor", "activation", "swiglu_alpha", "swiglu_limit")


def check_manifest_claims(manifest: Manifest, info: ModelInfo, ckpts: list[Checkpoint],
                          own_reader: FamilyReader | None) -> list[str]:
    """What the manifest says that the files can contradict (the schema checked its types):

    * ``layout.kernel_params`` are the model's activation constants;
    * kernel outputs: the backend's own description of the layout (``describe``) matches the
      manifest's ``layout`` table, and the router tensors ``layers`` names are in the checkpoint;
    * canonical outputs: the output reads back as the model ``model`` describes, and ``layers``
      names the layers' modules and routers as the output's own reader finds them.
    """
    from mxconv.run.plan import kernel_params

    problems: list[str] = []
    lay = manifest.layout  # json_value below: the whole table against describe(), value for value as JSON
    want = kernel_params(info)
    if lay.json_value("kernel_params") != want:
        problems.append(f"manifest layout.kernel_params is {lay.json_value('kernel_params')}, but the model's activation gives {want}")
    if manifest.is_kernel:
        advice: frozenset[str] = frozenset()  # the layout's advisory_keys: advice in words, there or not whatever its wording
        try:
            layout = get_layout(str(manifest.backend))
            advice = layout.advisory_keys
            desc = layout.describe(manifest_sizes(manifest), manifest.activation, layout.resolve_options(lay.option_values))
        except BadInput:  # unknown backend or options: the layout check of every layer says so
            desc = {}
        for key, value in json.loads(json.dumps(desc)).items():
            got = lay.json_value(key)
            if key in advice:
                differs = (got is None) != (value is None)
            else:
                differs = key not in _LAYOUT_KEYS_SET_BY_CONVERT and got != value
            if differs:
                problems.append(f"manifest layout.{key} is {got!r}, but the {manifest.backend} layout of these "
                                f"sizes and options has {value!r}")
        for row in manifest.layers:
            for key in ("router_weight", "router_bias", "correction_bias"):
                name = getattr(row, key)
                if name and name not in ckpts[0].tensors:
                    problems.append(f"manifest layers: layer {row.layer} {key} {name!r} is not in the checkpoint")
    elif own_reader is not None:
        own = own_reader.model_info()
        for f in MODEL_FIELDS:
            if getattr(own, f) != getattr(info, f):
                problems.append(f"manifest model.{f} is {getattr(info, f)!r}, but the checkpoint's config and tensors give "
                                f"{getattr(own, f)!r}")
        refs = {r.layer: r for r in own_reader.layer_refs()}
        for row in manifest.layers:
            ref = refs.get(row.layer)
            for key in ("module_prefix", "router_weight", "router_bias", "correction_bias"):
                if ref is not None and getattr(row, key) != getattr(ref, key):
                    problems.append(f"manifest layers: layer {row.layer} {key} is {getattr(row, key)!r}, but the checkpoint "
                                    f"has {getattr(ref, key)!r}")
    return problems


def model_info_of(model: ModelPart) -> ModelInfo:
    """The manifest's ``model`` table (validated by load_manifest) -> ModelInfo; keys a newer mxconv
    may add are ignored."""
    return ModelInfo.from_part(model)
