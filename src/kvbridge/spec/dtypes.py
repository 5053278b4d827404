"""KV and state dtypes: name → itemsize in bytes."""

from __future__ import annotations

import enum
from string import ascii_lowercase

from kvbridge.errors import SpecError


class DType(enum.StrEnum):
    BF16 = "bfloat16"
    FP16 = "float16"
    FP32 = "float32"
    FP64 = "float64"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"
    UINT8 = "uint8"

    @property
    def itemsize(self) -> int:
        """Bytes per element: the bit width in its name (``bfloat16``: 16, ``fp8_e4m3``: 8) / 8."""
        return _ITEMSIZE[self]


_ITEMSIZE = {d: int(d.split("_")[0].lstrip(ascii_lowercase)) // 8 for d in DType}
if min(_ITEMSIZE.values()) < 1:  # a sub-byte dtype needs its own rule: fail loudly here
    raise ImportError(f"kvbridge dtypes without a whole byte per element: {_ITEMSIZE}")

_ALIASES = {
    "bf16": DType.BF16,
    "fp16": DType.FP16,
    "half": DType.FP16,
    "fp32": DType.FP32,
    "float": DType.FP32,
    "fp64": DType.FP64,
    "double": DType.FP64,
    "fp8": DType.FP8_E4M3,
    "fp8_e4m3fn": DType.FP8_E4M3,
    "float8_e4m3fn": DType.FP8_E4M3,
    "float8_e5m2": DType.FP8_E5M2,
    "auto": DType.BF16,
}


def parse_dtype(name: str) -> DType:
    """``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` … → :class:`DType`."""
    key = name.strip().lower().removeprefix("torch.")
    if key in _ALIASES:
        return _ALIASES[key]
    try:
        return DType(key)
    except ValueError:
        known = sorted({d.value for d in DType} | set(_ALIASES))
        raise SpecError(f"unknown dtype {name!r}; known: {', '.join(known)}") from None
