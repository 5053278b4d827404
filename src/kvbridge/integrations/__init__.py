"""Adapters that run kvbridge inside real serving engines (vLLM)."""
