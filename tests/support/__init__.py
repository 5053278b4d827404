"""Helpers the tests share (test doubles, drivers)."""
