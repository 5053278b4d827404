"""kvbridge: move a request's KV cache from a prefill to a decode instance."""

__version__ = "0.1.0"
