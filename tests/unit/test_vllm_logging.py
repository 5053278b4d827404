"""kvbridge's log lines inside a vLLM engine: one handler, vLLM's layout, stream and level."""

from __future__ import annotations

import io
import logging
import os
import re
import sys
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
    for name in ("KVBRIDGE_LOG_LEVEL", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
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
    assert re.fullmatch(
        rf"\(MainProcess pid={os.getpid()}\) INFO \d\d-\d\d \d\d:\d\d:\d\d "
        r"\[kvbridge\.integrations\.vllm\.worker\] loaded 7 blocks",
        lines[0],
    ), lines[0]


def test_process_name_is_vllms_when_it_set_one(
    bare: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's record factory names the process (``EngineCore``); the line uses that name."""
    _no_root_handler(monkeypatch)
    out = io.StringIO()
    setup_logging(out)
    record = logging.LogRecord("kvbridge.x", logging.INFO, __file__, 1, "hi", None, None)
    record.vllm_process_name = "EngineCore"
    bare.handle(record)
    assert out.getvalue().startswith(f"(EngineCore pid={os.getpid()}) INFO "), out.getvalue()


@pytest.mark.parametrize(("value", "name"), [(None, "stdout"), ("ext://sys.stderr", "stderr")])
def test_stream_is_vllms(
    bare: logging.Logger, monkeypatch: pytest.MonkeyPatch, value: str | None, name: str
) -> None:
    """vLLM logs to stdout unless ``VLLM_LOGGING_STREAM`` says otherwise; so does kvbridge."""
    _no_root_handler(monkeypatch)
    if value is not None:
        monkeypatch.setenv("VLLM_LOGGING_STREAM", value)
    marker = io.StringIO()
    monkeypatch.setattr(sys, name, marker)
    setup_logging()
    logging.getLogger("kvbridge.x").info("to %s", name)
    assert marker.getvalue().endswith(f"] to {name}\n"), marker.getvalue()


def test_bad_stream_is_refused(bare: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_root_handler(monkeypatch)
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.nowhere")
    with pytest.raises(ConfigError, match="VLLM_LOGGING_STREAM"):
        setup_logging()
    assert bare.handlers == []


def test_nothing_when_vllm_configures_no_logging(
    bare: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_root_handler(monkeypatch)
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    monkeypatch.setenv("KVBRIDGE_LOG_LEVEL", "loud")  # not even read
    setup_logging(io.StringIO())
    assert bare.handlers == [] and bare.propagate


def test_level_defaults_to_vllms(bare: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_root_handler(monkeypatch)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")
    setup_logging(io.StringIO())
    assert bare.level == logging.DEBUG
    bare.handlers = []
    monkeypatch.setenv("KVBRIDGE_LOG_LEVEL", "ERROR")
    setup_logging(io.StringIO())
    assert bare.level == logging.ERROR


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
