"""The file names a checkpoint reader and the mxconv writer agree on.

Owned here, at the bottom of the stack, because reading a checkpoint (:mod:`mxconv.source.checkpoint`)
already needs every one of them; :mod:`mxconv.output` writes the same names.
"""

from __future__ import annotations

INDEX_NAME = "model.safetensors.index.json"  # the shard index: {"metadata": ..., "weight_map": {tensor: shard}}
MANIFEST_NAME = "mxconv.json"  # what the bytes of an mxconv output mean; written last (contract.md)
CONFIG_NAME = "config.json"  # the model's Hugging Face config
IN_PROGRESS = ".mxconv-in-progress"  # in an output directory while a run writes it (mxconv.source.in_progress)
