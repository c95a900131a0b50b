"""The CLI round of an MXFP8 kernel output shared by the layout tests: repack an MXFP8 checkpoint,
verify it bit-exact against that checkpoint, flip one real scale byte and see verify fail."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from support.cli import mx
from support.tamper import patch_tensor

from mxconv.experts.stack import CanonicalExperts
from mxconv.experts.tp import slice_tp, tp_ranges
from mxconv.source.st_format import read_header, read_tensor

__all__ = ["engine_row_holders", "flip_scale_byte", "quantized_mxfp8", "repack_verify_and_damage", "unpadded_round_trips"]


def flip_scale_byte(out: Path, rank: str | None, name: str, index: tuple[int, ...] = (2, 0, 5)) -> None:
    """Flip one bit of one real scale byte (expert 2; at ``index`` of its uint8 view) of ``name`` (in ``rank``'s
    directory, or the output's) and record the new sha256 in the manifest, so only the layout / reference
    checks can catch it."""
    where = out / rank if rank else out

    def flip(t: torch.Tensor) -> torch.Tensor:
        t.view(torch.uint8)[index] ^= 1
        return t

    patch_tensor(where, name, flip, fix_manifest=False)
    index = json.loads((where / "model.safetensors.index.json").read_text())
    t = read_tensor(read_header(where / index["weight_map"][name])[0][name])
    m = json.loads((out / "mxconv.json").read_text())
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    m["tensors"][f"{rank}/{name}" if rank else name]["sha256"] = hashlib.sha256(raw).hexdigest()
    (out / "mxconv.json").write_text(json.dumps(m))


def repack_verify_and_damage(q8: Path, out: Path, backend: str, tp: str, layer: int, *flags: str,
                             flip_at: tuple[int, ...] = (2, 0, 5)) -> dict[str, Any]:
    """``repack q8 out --backend backend --tp tp *flags``; verify --reference q8 must pass with every layer
    bit-exact; then a flipped scale byte of ``layer``'s w13 (last rank) must fail it (exit 1) naming
    the difference. Returns the output's manifest (read before the damage)."""
    code, _, err = mx("repack", q8, out, "--backend", backend, "--tp", tp, *flags, "--quiet", "--device", "cpu")
    assert code == 0, err
    manifest = json.loads((out / "mxconv.json").read_text())
    assert manifest["weight_format"] == "mxfp8" and manifest["layout"]["variant"] == "mxfp8"
    code, text, err = mx("verify", out, "--reference", q8, "--device", "cpu", "--json")
    assert code == 0, text + err
    assert {r["layout"] for r in json.loads(text)["layers"]} == {"bit-exact"}
    flip_scale_byte(out, f"rank-{int(tp) - 1}" if tp != "1" else None, f"model.layers.{layer}.mlp.experts.w13_weight_scale",
                    flip_at)
    code, text, err = mx("verify", out, "--reference", q8, "--device", "cpu")
    assert code == 1, text + err
    assert "recovered canonical bytes differ from the reference: w13_scale: first difference at expert 2" in text + err
    return manifest


def swapped_experts_fail(q8: Path, out: Path, backend: str, tensor: str, *flags: str) -> None:
    """``repack q8 out --backend backend *flags``, then experts 0 and 1 of ``tensor`` (e.g.
    ``model.layers.0.mlp.experts.w2_weight``) swapped and rehashed: verify --reference q8 must fail
    (exit 1) naming the first difference at expert 0 of that GEMM."""
    code, _, err = mx("repack", q8, out, "--backend", backend, *flags, "--quiet", "--device", "cpu")
    assert code == 0, err
    patch_tensor(out, tensor, lambda t: t[[1, 0, *range(2, t.shape[0])]].contiguous(), fix_manifest=True)
    code, text, err = mx("verify", out, "--reference", q8, "--device", "cpu")
    gemm = tensor.rsplit(".", 1)[1].removesuffix("_weight")
    assert code == 1 and f"{gemm}: first difference at expert 0" in text + err


def quantized_mxfp8(root: Path, hidden_size: int, intermediate_size: int) -> Path:
    """A Qwen-style test checkpoint (halves, no biases) of these sizes under ``root``, quantized to MXFP8."""
    from mxconv.examples import ModelSizes, make_checkpoint

    make_checkpoint(root / "src", "qwen3-moe", ModelSizes(hidden_size=hidden_size, intermediate_size=intermediate_size))
    code, _, err = mx("quantize", root / "src", root / "q8", "--format", "mxfp8", "--quiet", "--device", "cpu")
    assert code == 0, err
    return root / "q8"


def engine_row_holders(q8: Path, gpu: str) -> tuple[str, str, list[tuple[str, Any]]]:
    """``inspect q8 --engine vllm-0.33 --gpu gpu``'s first row: (kind, backend, [(holding output, refusal)])."""
    code, text, err = mx("inspect", q8, "--engine", "vllm-0.33", "--gpu", gpu, "--json")
    assert code == 0, err
    row = json.loads(text)["engine"]["gpus"][0]["rows"][0]
    return row["kind"], row["backend"], [(h["output"], h["refusal"]) for h in row["held_by"]]


def unpadded_round_trips(layout: Any, activation: str, c: CanonicalExperts, tp: int) -> list[tuple[CanonicalExperts, Any]]:
    """Each TP rank's slice of ``c`` through an MXFP8 form vLLM pads nothing for: its padded sizes are its own,
    ``from_kernel(to_kernel(part))`` gives every byte back with the row order and format. Returns (part, kernel
    tensors) per rank for further checks."""
    H, opts, out = c.hidden_size, layout.resolve_options(), []
    for rank, (s, e) in enumerate(tp_ranges(c.intermediate_size, tp)):
        part = slice_tp(c, s, e, rank)
        assert layout.padded_sizes(H, e - s, c.row_order, activation, opts, weight_format="mxfp8") == (H, e - s)
        k = layout.to_kernel(part, activation, opts)
        back = layout.from_kernel(k, part.sizes(H, e - s), activation, opts)
        assert back.weight_format == "mxfp8" and back.row_order == c.row_order
        for f in ("w13", "w13_scale", "w2", "w2_scale"):
            assert torch.equal(getattr(back, f), getattr(part, f)), (rank, f)
        out.append((part, k))
    return out
