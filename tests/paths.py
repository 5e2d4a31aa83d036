"""Where the repository and the tests' data lie, whatever folder a test module sits in."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
