"""Nothing outside OUTPUT (issue 29, the write side; docs/reliability.md):

* a source side file that is a FIFO, a device or huge is refused at once (exit 2) naming file and rule.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mxconv.source.side_files import SIDE_FILE_LIMIT
from support.cli import mx
from support.workspace import MadeCheckpoints, copy_checkpoint


@pytest.fixture(scope="module")
def src(made: MadeCheckpoints) -> Path:
    return made.source("qwen3-moe").path


def quantize(src: Path, out: Path, *options: object) -> tuple[int, str, str]:
    return mx("quantize", src, out, "--device", "cpu", "--quiet", *options)


# --- side files of the source: regular files within a bound, or exit 2 at once ----------------------


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_a_side_file_that_is_no_regular_file_or_is_huge_is_refused_at_once(src: Path, tmp_path: Path, kind: str) -> None:
    s = copy_checkpoint(src, tmp_path / "src")
    side = s / "tokenizer.json"
    side.unlink()
    if kind == "fifo":
        os.mkfifo(side)
        rule = "is a FIFO (named pipe); mxconv copies the files beside the weights"
    elif kind == "device":
        side.symlink_to("/dev/zero")
        rule = "is a device; mxconv copies the files beside the weights"
    else:
        with open(side, "wb") as f:
            f.truncate(SIDE_FILE_LIMIT + 1)  # sparse: takes no room
        rule = f"is 268.44 MB ({SIDE_FILE_LIMIT + 1} bytes), more than the {SIDE_FILE_LIMIT} bytes (256 MiB) a file copied beside the weights"
    out = tmp_path / "o"
    code, _, err = quantize(s, out)
    assert code == 2, err
    assert f"{side}: {rule}" in " ".join(err.split()), err
    assert not out.exists()


