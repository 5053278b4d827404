"""Argument types shared by the commands: each checks one flag's value at parse time, so a
bad value stops with one line that names the flag (argparse prefixes ``argument --flag:``)
and exit status 2, before any work starts. Imports nothing heavy: ``kvbridge --help``
loads this module."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

SIDE_KEYS = ("tp", "pp", "block", "layout")
_INT = re.compile(r"[+-]?\d+")
_SCI = re.compile(r"[+-]?\d+(\.\d+)?[eE]\+?\d+")
SEED_MAX = 2**63 - 1


def _integer(text: str) -> int:
    """``"5000"``, ``"1_000"`` or an integral ``"1e7"`` (exponent ≤ 18) → int; anything
    else a type error."""
    s = text.strip().replace("_", "")
    if _INT.fullmatch(s):
        return int(s)
    if _SCI.fullmatch(s) and int(s.lower().partition("e")[2]) <= 18:
        number = Decimal(s)
        if number == number.to_integral_value():
            return int(number)
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer")


def at_least(low: int, what: str = "an integer") -> Callable[[str], int]:
    """Type function: an integer ≥ ``low``."""

    def parse(text: str) -> int:
        n = _integer(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"{text} must be {what} ≥ {low}")
        return n

    parse.__name__ = f"integer ≥ {low}"
    return parse


positive = at_least(1)
"""Counts: ``--calls``, ``--tokens``, ``--new-tokens``."""
non_negative = at_least(0)
"""``--cached``, ``--cached-tokens``."""


def seed(text: str) -> int:
    """``--shuffle-blocks SEED``: an integer in [0, 2**63)."""
    n = _integer(text)
    if not 0 <= n <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{text}: a seed must be in [0, 2**63)")
    return n


def port(text: str) -> int:
    n = _integer(text)
    if not 0 < n < 65536:
        raise argparse.ArgumentTypeError(f"{text}: expected a port in 1..65535")
    return n


@dataclass(frozen=True, slots=True)
class SideSpec:
    """A ``"tp=2,pp=1,block=16,layout=hnd"`` value: the keys the user gave, nothing else.
    The command decides where omitted keys come from (see :meth:`resolve`)."""

    given: tuple[tuple[str, int | str], ...] = ()

    def resolve(self, *fallbacks: dict[str, int | str]) -> tuple[dict[str, int | str], list[str]]:
        """Every key: the given value, else the first fallback that has it. Returns the
        values and the keys that came from a fallback (for the command to say so)."""
        values, filled = dict(self.given), []
        for key in SIDE_KEYS:
            fb = next((fb for fb in fallbacks if key in fb), None)
            if key not in values and fb is not None:
                values[key] = fb[key]
                filled.append(key)
        return values, filled


def side(text: str) -> SideSpec:
    """Type function for ``--prefill``/``--decode``: ``key=value`` items, comma-separated,
    keys in :data:`SIDE_KEYS`, each at most once; numbers ≥ 1, a known layout."""
    given: dict[str, int | str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in SIDE_KEYS:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not key=value with key in {', '.join(SIDE_KEYS)}"
            )
        if key in given:
            raise argparse.ArgumentTypeError(f"{key} given twice in {text!r}")
        given[key] = _side_value(key, value)
    return SideSpec(tuple(given.items()))


def _side_value(key: str, value: str) -> int | str:
    if key == "layout":
        from kvbridge.layout.build import layout_names  # no numpy

        if value not in layout_names():
            raise argparse.ArgumentTypeError(
                f"layout={value!r}; known: {', '.join(layout_names())}"
            )
        return value
    try:
        number = _integer(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{key}={value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{key}={number} must be ≥ 1")
    return number


def size(text: str) -> int:
    """``--max-memory``: bytes, with an optional unit: ``8GiB``, ``512MiB``, ``2G``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 8GiB or 512MiB")
    scale = 1 << (10 * " KMGT".index(m.group(2).upper() or " "))
    n = int(float(m.group(1)) * scale)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return n
