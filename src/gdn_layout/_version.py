"""The installed version of gdn-layout."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("gdn-layout")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"
