"""A suite's ``manifest.json``, listing each fixture with its layout, regime, seed, size and
SHA-256: its one writer and its one reader (docs/files.md, *Suites: all or nothing*)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Final

from ._atomic import open_regular
from ._fixture import FORMAT, FORMAT_VERSION
from ._safetensors import FixtureError

#: The name of a suite's manifest, in the suite's folder.
MANIFEST: Final = "manifest.json"
#: What a manifest's ``format`` says.
SUITE_FORMAT: Final = FORMAT + "-suite"
#: A suite's manifest is at most this long (the standard suite's is about 100 KiB).
_MANIFEST_BYTES: Final = 64 << 20


class NotASuite(FixtureError):
    """A folder that holds no suite this library wrote; ``why`` says so after the folder's
    name ("it has no manifest.json", ...)."""

    def __init__(self, folder: Path, why: str) -> None:
        super().__init__(f"{folder}: not a suite: {why}")
        self.why = why


def read_manifest(folder: Path, *, dir_fd: int | None = None) -> list[dict[str, Any]]:
    """The entries of the manifest in ``folder`` (through the open folder ``dir_fd``), each
    with a plain, distinct ``file`` name and a ``sha256``; :class:`NotASuite` otherwise."""
    path = folder / MANIFEST
    try:
        with open_regular(path, dir_fd=dir_fd) as file:
            raw = file.read(_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise NotASuite(folder, f"it has no {MANIFEST}") from None
    except OSError as err:
        raise NotASuite(folder, f"its {MANIFEST} cannot be read ({err})") from None
    if len(raw) > _MANIFEST_BYTES:
        raise NotASuite(folder, f"its {MANIFEST} is over {_MANIFEST_BYTES >> 20} MiB")
    try:
        document = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # RecursionError: nesting
        raise NotASuite(folder, f"its {MANIFEST} is not JSON ({err})") from None
    entries = _entries(document)
    if entries is None:
        raise NotASuite(folder, f"its {MANIFEST} is not one gdn-layout wrote")
    return entries


def _entries(document: object) -> list[dict[str, Any]] | None:
    if not isinstance(document, dict) or document.get("format") != SUITE_FORMAT:
        return None
    entries = document.get("fixtures")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict)
        and isinstance(e.get("file"), str)
        and e["file"]
        and Path(e["file"]).name == e["file"]
        and isinstance(e.get("sha256"), str)
        for e in entries
    ):
        return None
    names = {e["file"] for e in entries}
    return entries if len(names) == len(entries) else None


def manifest_entry(name: str, data: bytes, **facts: Any) -> dict[str, Any]:
    """The entry of the fixture file ``name`` whose bytes are ``data``: ``facts`` (its
    layout, regime, seed, ...) with its size and SHA-256."""
    return {"file": name, **facts, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def manifest_text(entries: list[dict[str, Any]], **facts: Any) -> bytes:
    """The manifest listing ``entries``, with the suite's ``facts`` (version, dtype, seed)."""
    document = {"format": SUITE_FORMAT, "format_version": FORMAT_VERSION, **facts}
    document["fixtures"] = entries
    return (json.dumps(document, indent=1) + "\n").encode()
