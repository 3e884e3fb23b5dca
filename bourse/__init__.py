"""Bourse, the shared home of its programs (docs/architecture.md)."""

# The one place the version is written: the package's metadata reads it from here
# (pyproject.toml), and --version prints it without reading the installed metadata.
__version__ = "0.1.0"
