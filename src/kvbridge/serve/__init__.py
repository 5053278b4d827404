"""Serving P/D: an OpenAI-compatible proxy in front of P and D engine servers."""
