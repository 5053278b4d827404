"""Benchmarks that print figures (``kvbridge bench ...``)."""
