"""The generic name-keyed registry behind layouts, transports and engine mixers."""

from __future__ import annotations

import pytest

from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.registry import Registry


def test_items_are_kept_by_name_in_registration_order() -> None:
    reg: Registry[int] = Registry("widget", ConfigError)
    reg.register("b", 2)
    reg.register("a-1", 1)
    assert reg.names() == ("b", "a-1")
    assert reg.get("a-1") == 1 and "b" in reg and "c" not in reg and len(reg) == 2


def test_a_duplicate_a_bad_and_an_unknown_name_raise_the_registry_error() -> None:
    reg: Registry[int] = Registry("widget", ConfigError)
    reg.register("b", 2)
    with pytest.raises(ConfigError, match="widget 'b' is registered already"):
        reg.register("b", 3)
    assert reg.get("b") == 2  # the first registration stays
    for bad in ("", "a b", "a,b", "k=v"):
        with pytest.raises(ConfigError, match="widget name"):
            reg.register(bad, 1)
    with pytest.raises(ConfigError, match=r"^unknown widget 'z'; known: b$"):
        reg.get("z")
    assert reg.names() == ("b",)


def test_the_default_error_is_the_base_kvbridge_error() -> None:
    with pytest.raises(KVBridgeError, match=r"^unknown thing 'x'; known: $"):
        Registry[str]("thing").get("x")
