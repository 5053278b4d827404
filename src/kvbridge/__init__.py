"""kvbridge: move a request's KV cache from a prefill to a decode instance.

The public API is :mod:`kvbridge.api`; its names are also reachable here
(``kvbridge.Consumer``), imported on first use so that ``import kvbridge`` stays cheap."""

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A name of :mod:`kvbridge.api`, loaded on first use; never for a submodule's name
    (``from kvbridge import catalog`` asks for it first, and must not load the API)."""
    public = name.isidentifier() and not name.startswith("_")
    if public and importlib.util.find_spec(f"{__name__}.{name}") is None:
        api = importlib.import_module("kvbridge.api")
        if name in api.__all__:
            globals()[name] = value = getattr(api, name)
            return value
    raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *importlib.import_module("kvbridge.api").__all__])
