"""The reference engine: a small paged-KV decoder whose cache is laid out by
kvbridge, with real TP over processes. See ``docs/engine.md``."""

from kvbridge.engine.config import MIXERS, PRESETS, ModelConfig, preset
from kvbridge.engine.errors import EngineError
from kvbridge.engine.generate import generate
from kvbridge.engine.instance import Instance, Prefilled, Status
from kvbridge.engine.spec import model_spec
from kvbridge.engine.tokenizer import decode, encode
from kvbridge.engine.transfer import Moved, move_kv

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
