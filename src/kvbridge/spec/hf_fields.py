"""Typed reading of a ``config.json`` section (or spec file); every error names its field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import ConfigError, SpecError
from kvbridge.spec.dtypes import DType, parse_dtype


@dataclass(slots=True)
class Fields:
    """Read-only access to one config section (the top level, or ``text_config`` of a
    multimodal checkpoint) with field paths in the errors.

    ``prefix`` is the section's path (``"text_config."``); ``defaults`` the architecture's
    class defaults for keys the file omits; ``outer`` the enclosing section,
    consulted for keys the section lacks when reading dtypes (``torch_dtype`` sits at the
    top of multimodal files); ``applied``: the class defaults used, shared with ``outer``.
    """

    data: Mapping[str, Any]
    prefix: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    outer: Fields | None = None
    applied: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.applied = {} if self.outer is None else self.outer.applied

    def path(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def get(self, key: str) -> Any:
        """The value of ``key``; ``None`` when absent or null and without a class default."""
        value = self.data.get(key)
        if value is None and key in self.defaults:
            value = self.defaults[key]
            self.applied[self.path(key)] = value
        return value

    def has(self, key: str) -> bool:
        return self.get(key) is not None

    def req_int(self, key: str, minimum: int = 1) -> int:
        """A required integer ``≥ minimum``."""
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{self.path(key)}: missing (required)")
        return self._check_int(key, value, minimum)

    def opt_int(self, key: str, minimum: int = 1) -> int | None:
        value = self.get(key)
        return None if value is None else self._check_int(key, value, minimum)

    def first_int(self, *keys: str) -> int:
        """The first of several spellings of one field (``mamba_n_heads`` | ``mamba_num_heads``)."""
        for key in keys:
            if self.has(key):
                return self.req_int(key)
        names = " or ".join(self.path(k) for k in keys)
        raise ConfigError(f"{names}: missing (required)")

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.path(key)}: expected true or false, got {value!r}")
        return value

    def int_list(self, key: str, minimum: int = 0) -> list[int]:
        value = self.items(key)
        return [self._check_int(f"{key}[{i}]", v, minimum) for i, v in enumerate(value)]

    def str_list(self, key: str) -> list[str]:
        value = self.items(key)
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise ConfigError(f"{self.path(key)}[{i}]: expected a string, got {v!r}")
        return list(value)

    def items(self, key: str) -> list[Any]:
        return self._typed(key, list, "a list")

    def text(self, key: str) -> str:
        return self._typed(key, str, "a string")

    def section(self, key: str) -> Fields:
        return Fields(self._typed(key, Mapping, "an object"), self.path(key) + ".", outer=self)

    def dtype(self, *keys: str) -> DType | None:
        """The dtype named by the first present key, here or in the enclosing sections."""
        for key in keys:
            value = self.get(key)
            if value is not None:
                try:
                    return parse_dtype(str(value))
                except SpecError as e:
                    raise ConfigError(f"{self.path(key)}: {e}") from None
        return self.outer.dtype(*keys) if self.outer is not None else None

    def _check_int(self, key: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.path(key)}: expected an integer, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{self.path(key)}: {value} < {minimum}")
        return value

    def _typed(self, key: str, kind: type, what: str) -> Any:
        value = self.get(key)
        if not isinstance(value, kind):
            got = "missing" if value is None else f"got {value!r}"
            raise ConfigError(f"{self.path(key)}: expected {what}, {got}")
        return value
