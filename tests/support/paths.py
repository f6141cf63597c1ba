"""Where tests find the repository (jobs/, scripts/, schemas/, the package's source) and their own
data files."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
