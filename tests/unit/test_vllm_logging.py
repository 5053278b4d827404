"""kvbridge's log lines inside a vLLM engine: one handler, vLLM's layout, INFO shown."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator

import pytest

from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.config import setup_logging


@pytest.fixture
def bare(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The ``kvbridge`` logger as in a fresh vLLM process, no handler on it; restored
    afterwards. Each test then hides pytest's root handlers (added after fixtures run)."""
    logger = logging.getLogger("kvbridge")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    monkeypatch.delenv("KVBRIDGE_LOG_LEVEL", raising=False)
    logger.handlers = []
    yield logger
    logger.handlers, logger.level, logger.propagate = saved[0], saved[1], saved[2]


def _no_root_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def test_twice_leaves_one_handler(bare: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_root_handler(monkeypatch)
    setup_logging(io.StringIO())
    setup_logging(io.StringIO())
    assert len(bare.handlers) == 1
    assert bare.propagate is False


def test_info_line_has_level_time_and_process(
    bare: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_root_handler(monkeypatch)
    out = io.StringIO()
    setup_logging(out)
    setup_logging(out)
    logging.getLogger("kvbridge.integrations.vllm.worker").info("loaded %d blocks", 7)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("INFO ")
    assert f"/{os.getpid()}] kvbridge.integrations.vllm.worker: loaded 7 blocks" in lines[0]


def test_level_from_env(bare: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_root_handler(monkeypatch)
    monkeypatch.setenv("KVBRIDGE_LOG_LEVEL", "warning")
    out = io.StringIO()
    setup_logging(out)
    logging.getLogger("kvbridge.x").info("hidden")
    logging.getLogger("kvbridge.x").warning("shown")
    assert out.getvalue().count("\n") == 1 and "WARNING" in out.getvalue()


def test_bad_level_is_refused(bare: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_root_handler(monkeypatch)
    monkeypatch.setenv("KVBRIDGE_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match="KVBRIDGE_LOG_LEVEL"):
        setup_logging(io.StringIO())
    assert bare.handlers == []


def test_left_alone_when_the_process_set_up_logging() -> None:
    """Under pytest the root logger has handlers: records keep propagating to them."""
    logger = logging.getLogger("kvbridge")
    before = list(logger.handlers)
    assert logging.getLogger().handlers
    setup_logging(io.StringIO())
    assert logger.handlers == before and logger.propagate
