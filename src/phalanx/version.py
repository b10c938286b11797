"""phalanx's version: a leaf module (it imports nothing), so that any module can read the
version without importing the package root (and through it every other module)."""

__version__ = "0.1.0"  # (pyproject.toml's [project] version; a test checks they agree)
