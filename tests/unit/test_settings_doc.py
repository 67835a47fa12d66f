"""Every service setting is in the operations guide's table: the table is written by hand,
so this keeps it from falling behind the settings object that owns them."""

from pathlib import Path

from lastgood_service.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def test_every_setting_is_documented():
    doc = DOC.read_text()
    missing = [f"LASTGOOD_{name.upper()}" for name in Settings.model_fields if f"LASTGOOD_{name.upper()}" not in doc]
    assert not missing, f"add these to docs/operations.md: {missing}"
