"""The installed version of gdn-layout."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gdn-layout")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"
