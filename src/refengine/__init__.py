"""The reference engine: a small paged-KV decoder whose cache is laid out by
kvbridge, with real TP over processes. See ``docs/engine.md``."""

from refengine.config import MIXERS, PRESETS, ModelConfig, preset
from refengine.errors import EngineError
from refengine.generate import generate
from refengine.instance import Instance, Prefilled, Status
from refengine.spec import model_spec
from refengine.tokenizer import decode, encode
from refengine.transfer import Moved, move_kv

__all__ = [
    "MIXERS",
    "PRESETS",
    "EngineError",
    "Instance",
    "ModelConfig",
    "Moved",
    "Prefilled",
    "Status",
    "decode",
    "encode",
    "generate",
    "model_spec",
    "move_kv",
    "preset",
]
