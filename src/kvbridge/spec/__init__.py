"""Spec: what a model stores (map: ``docs/structure.md``)."""

from kvbridge.spec.build import (
    attention,
    gated_deltanet,
    group_by_kind,
    kimi_delta,
    mamba1,
    mamba2,
    mla,
    state,
    state_tensor,
)
from kvbridge.spec.dtypes import DType, parse_dtype
from kvbridge.spec.hf import from_hf_config
from kvbridge.spec.info import ModelInfo
from kvbridge.spec.load import load_model
from kvbridge.spec.model import Group, Kind, Layer, ModelSpec, Segment, Stream
from kvbridge.spec.parallel import Parallel, shard_interval

__all__ = [
    "DType",
    "Group",
    "Kind",
    "Layer",
    "ModelInfo",
    "ModelSpec",
    "Parallel",
    "Segment",
    "Stream",
    "attention",
    "from_hf_config",
    "gated_deltanet",
    "group_by_kind",
    "kimi_delta",
    "load_model",
    "mamba1",
    "mamba2",
    "mla",
    "parse_dtype",
    "shard_interval",
    "state",
    "state_tensor",
]
