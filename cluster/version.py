"""pdserve's version: the installed distribution's, as `pdserve --version`, GET /version and
ModelInfo report it (from pyproject.toml when running from a checkout without an install)."""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "pdserve"


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return m.group(1) if m else "0+unknown"
