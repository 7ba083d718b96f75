"""The package's version and source folder, for the records a run and a suite keep (``grpolab.__version__`` is
this version)."""

from pathlib import Path

VERSION = "0.1.0"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
