"""scripts/numerics_table.py, the evidence behind the default scale rules: real weights from a
safetensors file and from a torch state dict get weight and layer errors for every rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "numerics_table.py"


def test_real_weights_rows(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    save_file({"a.weight": torch.randn(64, 64, generator=g) * 0.3, "a.bias": torch.randn(64, generator=g),
               "odd.weight": torch.randn(8, 40, generator=g)}, str(tmp_path / "m.safetensors"))
    torch.save({"model_state": {"l.weight": torch.randn(32, 96, generator=g), "l.bias": torch.zeros(32)}}, tmp_path / "m.pt")
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--hidden", "64", "--intermediate", "32", "--seeds", "1",
                        "--tokens", "16", "--real", f"st={tmp_path / 'm.safetensors'}", str(tmp_path / "m.pt"),
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    real = [x for x in rows if not x["weights"].startswith(("gaussian", "student-t", "outliers"))]
    assert {x["weights"] for x in real} == {"st (1 matrices)", "m (1 matrices)"}  # 2-D, last axis % 32 only
    assert len(real) == 2 * 2 * 3  # files x formats x rules
    for x in real:
        assert 0 < x["weight_rel_rms"] < 0.3 and 0 < x["layer_rel_rms"] < 0.3
        if x["rule"] == "rceil":
            assert x["weight_vs_rceil"] == 1.0 and x["layer_vs_rceil"] == 1.0
    torch.save({"b": torch.zeros(7)}, tmp_path / "none.pt")  # nothing usable: said, not a silent empty row
    r = subprocess.run([sys.executable, str(SCRIPT), "--seeds", "1", "--hidden", "64", "--intermediate", "32",
                        "--real", str(tmp_path / "none.pt")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "none.pt: no 2-D float tensor whose last axis is a multiple of 32" in r.stderr
