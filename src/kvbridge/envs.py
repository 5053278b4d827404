"""All environment variables kvbridge reads, in one place."""

from __future__ import annotations

import os

from kvbridge.errors import ConfigError

DEFAULTS = {
    # UCX's IB module segfaults at process exit (docs/performance.md, NIXL on this machine class).
    "UCX_MODULES": "^ib",
    "NIXL_LOG_LEVEL": "WARN",
    # Over TCP (P and D on different hosts) UCX moves a READ in segments of this size;
    # its 8 KiB default held NIXL to ~50 % of a plain socket copy between two network
    # namespaces, 2 MiB reached 80-127 % (docs/faults.md, benchmarks.two_hosts).
    # Buffers are taken per connection, lazily: an idle agent's memory is unchanged.
    "UCX_TCP_TX_SEG_SIZE": "2m",
    "UCX_TCP_RX_SEG_SIZE": "2m",
}


def prepare_process_env() -> None:
    """Set transport-related defaults before the first NIXL agent exists."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)


def progress_delay_us() -> int:
    """Delay of NIXL's progress thread between polls (µs); 0 would spin a core."""
    return int(os.environ.get("KVBRIDGE_PROGRESS_DELAY_US", "1000"))


def ucx_threads() -> int:
    """``KVBRIDGE_UCX_THREADS`` (default 0: NIXL's default, none): UCX worker threads of
    kvbridge's NIXL agents (the UCX backend's ``num_threads``); a transfer's descriptors
    are spread over them. On host memory (2-core VM) 4 KiB runs moved 1.6 → 2.9 GB/s and
    64 B runs cost 1.5 → 0.9 µs each, but a peer killed mid-transfer then aborted the
    process in UCX (``ucs_arbiter_group_is_empty`` at endpoint teardown): off by default
    (docs/performance.md, "UCX worker threads")."""
    raw = os.environ.get("KVBRIDGE_UCX_THREADS", "0")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"KVBRIDGE_UCX_THREADS={raw!r}: not a whole number") from None


def device_on_cpu() -> bool:
    """``KVBRIDGE_DEVICE_ON_CPU=1``: on a machine without CUDA, device regions are host
    memory reached through torch CPU tensors (the test suite's way through the device code
    paths; :mod:`kvbridge.transport.memory`)."""
    return os.environ.get("KVBRIDGE_DEVICE_ON_CPU", "") == "1"


def nixl_module() -> str:
    """``KVBRIDGE_NIXL``: the NIXL Python package to load (default: the ``nixl`` meta
    package, which picks the build matching the machine's CUDA, then ``nixl_cu13``,
    ``nixl_cu12``; :mod:`kvbridge.transport.nixl`)."""
    return os.environ.get("KVBRIDGE_NIXL", "")


def triton_copies() -> bool:
    """``KVBRIDGE_TRITON`` (default "1"): CUDA copies may use the fused Triton kernel;
    "0" keeps them on torch's index kernels (:mod:`kvbridge.connector.movers.device_copies`)."""
    return os.environ.get("KVBRIDGE_TRITON", "1") != "0"


def triton_specialise() -> bool:
    """``KVBRIDGE_TRITON_SPECIALISE`` (default "1"): lengths copied often get the fused
    kernel compiled with the length as a constant, off the copy path; "0" keeps the
    generic kernel (:mod:`kvbridge.connector.movers.triton_copy`)."""
    return os.environ.get("KVBRIDGE_TRITON_SPECIALISE", "1") != "0"


def log_level() -> str:
    """``KVBRIDGE_LOG_LEVEL`` (default: vLLM's ``VLLM_LOGGING_LEVEL``, else "INFO"): level
    of the ``kvbridge`` logger inside a vLLM engine
    (:func:`kvbridge.integrations.vllm.config.setup_logging`)."""
    default = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
    return os.environ.get("KVBRIDGE_LOG_LEVEL", default).strip().upper()


def vllm_log_stream() -> str:
    """vLLM's ``VLLM_LOGGING_STREAM`` (default ``ext://sys.stdout``, as in vLLM): where
    kvbridge's lines go inside a vLLM engine."""
    return os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stdout").strip()


def vllm_configures_logging() -> bool:
    """vLLM's ``VLLM_CONFIGURE_LOGGING`` (default "1"); "0": vLLM sets up no logging, and
    neither does kvbridge."""
    return os.environ.get("VLLM_CONFIGURE_LOGGING", "1").strip() != "0"
