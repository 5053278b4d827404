"""Built-in model catalog: one folder per model, ``<name>/config.json``, a Hugging Face
configuration with the KV-relevant fields of the published file (provenance of every
value in ``sources.json``). ``kvbridge.spec.load_model("llama-3.1-8b")`` and
``kvbridge plan --model llama-3.1-8b`` read them by name."""

from __future__ import annotations

from pathlib import Path

from kvbridge.errors import ConfigError

CATALOG_DIR = Path(__file__).resolve().parent


def names() -> tuple[str, ...]:
    """The catalog's model names, sorted."""
    return tuple(sorted(p.parent.name for p in CATALOG_DIR.glob("*/config.json")))


def config_path(name: str) -> Path:
    """The catalog's ``<name>/config.json``; :class:`ConfigError` listing the known names
    if there is no such model."""
    known = names()
    if name not in known:
        raise ConfigError(
            f"{name!r}: no such file, and no catalog model of that name (known: {', '.join(known)})"
        )
    return CATALOG_DIR / name / "config.json"
