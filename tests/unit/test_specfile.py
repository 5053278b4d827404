"""The neutral spec file: it round-trips every spec, its shorthands equal the Python
builders, the documented example loads, and mistakes name their field."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.cli.main import main
from kvbridge.errors import ConfigError, SpecError
from kvbridge.spec import DType, Group, Kind, Layer, ModelSpec, Stream, attention, mla, state
from kvbridge.spec.hf import from_hf_config, load_config
from kvbridge.spec.info import default_groups
from kvbridge.spec.load import load_model
from kvbridge.spec.model import Segment
from kvbridge.spec.specfile import dump_spec_file, spec_from_dict, spec_to_dict

from .test_hf_configs import MODELS, MODELS_DIR

DOC = Path(__file__).resolve().parents[2] / "docs" / "spec-file.md"


def round_trip(spec: ModelSpec) -> ModelSpec:
    return spec_from_dict(json.loads(dump_spec_file(spec))).spec


@pytest.mark.parametrize("name", MODELS)
def test_every_model_round_trips(name: str) -> None:
    spec = from_hf_config(load_config(MODELS_DIR / name), name).spec
    back = round_trip(spec)
    assert back == spec
    assert back.compat_hash() == spec.compat_hash()


@st.composite
def streams(draw: st.DrawFn, per_token: bool) -> Stream:
    dtype = draw(st.sampled_from(list(DType)))
    n_seg = draw(st.integers(1, 3))
    segs = tuple(
        Segment(draw(st.integers(1, 64)), draw(st.integers(1, 5000))) for _ in range(n_seg)
    )
    rows = 0 if per_token else draw(st.integers(1, 5))
    name = draw(st.sampled_from(["k", "v", "conv_state", "ssm", "x y"]))
    return Stream(name, segs, dtype, rows=rows, replicated=draw(st.booleans()))


@st.composite
def layers(draw: st.DrawFn, index: int) -> Layer:
    kind = draw(st.sampled_from(list(Kind)))
    dtype = draw(st.sampled_from(list(DType)))
    choice = draw(st.integers(0, 2))
    if choice == 0 and kind is Kind.MLA:
        return mla(index, draw(st.integers(1, 1000)), dtype)
    if choice == 0 and kind is not Kind.STATE:
        heads, dim = draw(st.integers(1, 16)), draw(st.integers(1, 256))
        window = draw(st.integers(1, 9000)) if kind is Kind.SLIDING else 0
        chunk = draw(st.integers(1, 9000)) if kind is Kind.CHUNKED else 0
        return attention(index, heads, dim, dtype, kind, window, chunk)
    window = draw(st.integers(1, 100)) if kind is Kind.SLIDING else 0
    chunk = draw(st.integers(1, 100)) if kind is Kind.CHUNKED else 0
    if choice == 1:
        return Layer(index, kind, (), window=window, chunk=chunk)
    per_token = kind is not Kind.STATE
    ss = draw(st.lists(streams(per_token), min_size=1, max_size=3, unique_by=lambda s: s.name))
    return Layer(index, kind, tuple(ss), window=window, chunk=chunk)


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    n = draw(st.integers(1, 6))
    lays = [draw(layers(i)) for i in range(n)]
    if not any(lay.streams for lay in lays):
        lays[0] = attention(0, 2, 8)
    groups = default_groups(lays, draw(st.integers(1, 64)))
    if draw(st.booleans()):  # a group of its own for the first cached layer
        g = groups[0]
        if len(g.layers) > 1:
            head = Group(f"{g.name}-0", g.layers[:1], g.block_size + 1)
            groups = (head, Group(g.name, g.layers[1:], g.block_size), *groups[1:])
    return ModelSpec(draw(st.sampled_from(["m", "tiny-hybrid"])), tuple(lays), groups)


@settings(max_examples=60, deadline=None)
@given(specs())
def test_any_spec_round_trips(spec: ModelSpec) -> None:
    assert round_trip(spec) == spec


def test_documented_example_loads_and_plans(tmp_path: Path) -> None:
    blocks = re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S)
    assert blocks, f"no TOML example in {DOC}"
    path = tmp_path / "model.toml"
    path.write_text(blocks[0])
    info = load_model(path)
    kinds = {lay.kind for lay in info.spec.layers}
    assert kinds == set(Kind)
    assert main(["plan", "--model", str(path), "--tokens", "100", "--decode", "tp=2"]) == 0


def doc(**layer: Any) -> dict[str, Any]:
    return {"kvbridge_spec": 1, "layers": [layer]}


def test_shorthands_equal_the_builders() -> None:
    data = {
        "kvbridge_spec": 1,
        "name": "s",
        "dtype": "fp16",
        "block_size": 32,
        "layers": [
            {"kind": "full", "kv_heads": 8, "head_dim": 128, "repeat": 2},
            {"kind": "sliding", "window": 512, "kv_heads": 4, "head_dim": 64, "v_head_dim": 32},
            {"kind": "mla", "latent_width": 576, "dtype": "bf16"},
            {"kind": "full", "streams": []},
            {"kind": "state", "streams": [{"name": "s", "rows": 2, "segments": [[4, 8]]}]},
        ],
    }
    spec = spec_from_dict(data).spec
    fp16 = DType.FP16
    want = [
        attention(0, 8, 128, fp16),
        attention(1, 8, 128, fp16),
        attention(2, 4, 64, fp16, Kind.SLIDING, window=512, v_head_dim=32),
        mla(3, 576),
        Layer(4, Kind.FULL, ()),
        state(5, [Stream("s", (Segment(4, 16),), fp16, rows=2)]),
    ]
    assert list(spec.layers) == want
    assert spec.groups == default_groups(want, 32)


def test_toml_and_json_read_the_same(tmp_path: Path) -> None:
    toml_text = 'kvbridge_spec = 1\n[[layers]]\nkind = "full"\nkv_heads = 2\nhead_dim = 8\n'
    (tmp_path / "a.toml").write_text(toml_text)
    (tmp_path / "a.json").write_text(json.dumps(tomllib.loads(toml_text)))
    assert load_model(tmp_path / "a.toml").spec == load_model(tmp_path / "a.json").spec


def test_kv_dtype_override() -> None:
    data = doc(kind="full", kv_heads=2, head_dim=8)
    data["layers"].append(
        {"kind": "state", "streams": [{"name": "s", "rows": 1, "segments": [[2, 4]]}]}
    )
    spec = spec_from_dict(data, DType.FP8_E4M3).spec
    assert spec.token_bytes(Kind.FULL) == 2 * 2 * 8
    assert spec.state_bytes == 2 * 4 * 2  # state streams keep their dtype
    raw = doc(kind="full", streams=[{"name": "k", "segments": [{"units": 2, "bytes": 6}]}])
    assert spec_from_dict(raw).spec.token_bytes(Kind.FULL) == 12
    with pytest.raises(ConfigError, match=r"layers\[0\]\.streams\[0\]\.segments\[0\]\.bytes"):
        spec_from_dict(raw, DType.FP8_E4M3)


BAD = {
    "no version": ({"layers": []}, "kvbridge_spec: missing"),
    "version 2": ({"kvbridge_spec": 2, "layers": []}, "version 2 is not supported"),
    "no layers": ({"kvbridge_spec": 1, "layers": []}, "layers: the spec has no layers"),
    "unknown top key": ({"kvbridge_spec": 1, "layer": []}, "layer: unknown key"),
    "unknown layer key": (doc(kind="full", kv_head=2, head_dim=8), r"layers\[0\]\.kv_head"),
    "no kind": (doc(kv_heads=2, head_dim=8), r"layers\[0\]\.kind: expected a string"),
    "bad kind": (doc(kind="linear", streams=[]), "unknown kind 'linear'"),
    "window on full": (doc(kind="full", window=8, kv_heads=1, head_dim=8), r"\.window: only"),
    "no window": (doc(kind="sliding", kv_heads=1, head_dim=8), r"layers\[0\]\.window: missing"),
    "both forms": (doc(kind="full", kv_heads=1, head_dim=8, streams=[]), "not both"),
    "neither form": (doc(kind="full"), "not neither"),
    "state shorthand": (doc(kind="state", kv_heads=1, head_dim=8), r"layers\[0\]\.kind"),
    "no head_dim": (doc(kind="full", kv_heads=2), r"layers\[0\]\.head_dim: missing"),
    "bad segment": (
        doc(kind="full", streams=[{"name": "k", "segments": [[1, 2, 3]]}]),
        r"segments\[0\]: expected \[units, elements\]",
    ),
    "zero units": (
        doc(kind="full", streams=[{"name": "k", "segments": [[0, 2]]}]),
        r"segments\[0\]\.units: 0 < 1",
    ),
    "bad dtype": (doc(kind="mla", latent_width=8, dtype="fp7"), r"layers\[0\]\.dtype"),
    "bad repeat": (doc(kind="mla", latent_width=8, repeat=0), r"layers\[0\]\.repeat: 0 < 1"),
}


@pytest.mark.parametrize("case", BAD)
def test_mistakes_name_their_field(case: str) -> None:
    data, needle = BAD[case]
    with pytest.raises(ConfigError, match=needle):
        spec_from_dict(data)


def test_inconsistent_spec_is_a_spec_error() -> None:
    data = doc(kind="state", streams=[{"name": "s", "segments": [[1, 2]]}])  # rows missing
    with pytest.raises(SpecError, match="rows=0"):
        spec_from_dict(data)
    data = doc(kind="full", kv_heads=1, head_dim=8)
    data["groups"] = [{"name": "g", "layers": [0, 1]}]
    with pytest.raises(SpecError, match="names layer 1"):
        spec_from_dict(data)


def test_to_dict_spells_out_bytes_that_are_not_whole_elements() -> None:
    spec = ModelSpec(
        "odd",
        (Layer(0, Kind.FULL, (Stream("k", (Segment(2, 3),), DType.FP16),)),),
        (Group("attn", (0,), 16),),
    )
    (layer,) = spec_to_dict(spec)["layers"]
    assert layer["streams"][0]["segments"] == [{"units": 2, "bytes": 3}]
    assert round_trip(spec) == spec
