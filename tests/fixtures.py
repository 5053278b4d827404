"""The model fixtures, all in the repository: each model's ``config.json`` is in the
package's catalog (``src/kvbridge/catalog/<name>/``), the facts derived from it in
``tests/data/models/<name>/expected.json`` (keys explained in that folder's README)."""

from __future__ import annotations

from pathlib import Path

from kvbridge.catalog import CATALOG_DIR

MODELS_DIR = CATALOG_DIR
"""``<name>/config.json`` of every catalog model."""
EXPECTED_DIR = Path(__file__).resolve().parent / "data" / "models"
"""``<name>/expected.json`` of every catalog model."""
