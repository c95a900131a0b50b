"""Model-family registry. Adding a family = one new module + one line in ``_REGISTRY``."""

from __future__ import annotations

from mxconv.source.checkpoint import Checkpoint
from mxconv.errors import BadInput
from mxconv.families.base import FamilyReader
from mxconv.registry import register, resolve

# family name -> "module:ReaderClass", in detection order (most specific first).
_REGISTRY: dict[str, str | type[FamilyReader]] = {
    "gpt-oss-quark": "mxconv.families.quark_gpt_oss:QuarkGptOssReader",
    "gpt-oss": "mxconv.families.gpt_oss:GptOssReader",
    "deepseek-v3": "mxconv.families.deepseek:DeepseekV3Reader",
    "glm4-moe": "mxconv.families.glm:Glm4MoeReader",
    "qwen-moe": "mxconv.families.qwen_moe:QwenMoeReader",
    "mixtral": "mxconv.families.mixtral:MixtralReader",
}

FAMILIES: tuple[str, ...] = tuple(_REGISTRY)


def register_family(name: str, reader: str | type[FamilyReader]) -> None:
    """Register a reader class (or ``"module:Class"``) under ``name``, detected after the built-ins.

    The built-in families are the lines of ``_REGISTRY``; this is for plug-ins and tests.
    """
    register(_REGISTRY, "family", name, reader)


def unregister_family(name: str) -> None:
    """Remove a family added with :func:`register_family`."""
    _REGISTRY.pop(name, None)


def reader_class(name: str) -> type[FamilyReader]:
    return resolve(_REGISTRY, name)


def detect_family(ckpt: Checkpoint) -> FamilyReader:
    """The reader for ``ckpt``; BadInput listing the supported families when none matches."""
    for name in _REGISTRY:
        cls = reader_class(name)
        if cls.detect(ckpt):
            return cls(ckpt)
    model_type = ckpt.cfg("model_type", default="?")
    archs = ckpt.config.get("architectures") or ["?"]
    raise BadInput(
        f"{ckpt.root}: unknown model family (model_type {model_type!r}, architectures {archs}); "
        f"supported families: {', '.join(reader_class(n).title for n in _REGISTRY)}"
    )


__all__ = ["FAMILIES", "register_family", "unregister_family", "detect_family", "reader_class"]
