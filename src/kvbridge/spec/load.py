"""One entry point for a model description: a directory holding ``config.json``, a
``config.json`` itself, a kvbridge spec file (``.toml``, or JSON with ``kvbridge_spec``),
or the bare name of a model in :mod:`kvbridge.catalog` (``"llama-3.1-8b"``)."""

from __future__ import annotations

from pathlib import Path

from kvbridge import catalog
from kvbridge.errors import ConfigError
from kvbridge.spec.dtypes import DType
from kvbridge.spec.hf import from_hf_config, load_config
from kvbridge.spec.info import ModelInfo
from kvbridge.spec.specfile import spec_from_dict


def load_model(
    path: str | Path, kv_dtype: DType | None = None, ssm_dtype: DType | None = None
) -> ModelInfo:
    """The spec of the model at ``path`` (or of the catalog model of that name, if no such
    path exists); a config's name is its directory's name."""
    p = model_path(path)
    data = load_config(p)
    if p.suffix == ".toml" or "kvbridge_spec" in data:  # a spec file
        if ssm_dtype is not None:
            raise ConfigError("--ssm-dtype: a spec file names the dtype of each state stream")
        return spec_from_dict(data, kv_dtype)
    name = p.resolve().parent.name if p.name == "config.json" else p.stem
    return from_hf_config(data, name, kv_dtype, ssm_dtype)


def model_path(path: str | Path) -> Path:
    """The file ``path`` names: itself, a directory's ``config.json``, or for a bare name
    (one path part, not a file name) the catalog's config."""
    p = Path(path)
    if p.is_dir():
        return p / "config.json"
    if p.exists() or len(p.parts) != 1 or p.name.endswith((".json", ".toml")):
        return p
    return catalog.config_path(p.name)
