"""What every test file shares: the ``gpu`` mark's skip and the session's checkpoint factory.

- Tests marked ``gpu`` are skipped, in one place, on a machine without CUDA (the mark stays on the
  test, so ``-m gpu`` still selects them on the device).
- ``made`` (session scope) makes each tiny source checkpoint and each quantize / repack output once
  per session, by what made it; see :class:`support.workspace.MadeCheckpoints`.
"""

from __future__ import annotations

import pytest
import torch

from support.workspace import MadeCheckpoints


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``gpu``-marked test when this machine has no CUDA device."""
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def made(tmp_path_factory: pytest.TempPathFactory) -> MadeCheckpoints:
    """Sources and their conversions, each made once per session under one session folder."""
    return MadeCheckpoints(tmp_path_factory.mktemp("made"))
