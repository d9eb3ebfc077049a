"""The PEM files of TLS settings, read the same way by the server and the clients."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def read_pem_files(paths: Mapping[str, str], label: str = "{}") -> dict[str, bytes]:
    """The bytes of each file of ``paths`` (setting name to path) whose path is not empty.

    Raises:
        ValueError: a file is missing; the message names its setting as ``label.format(name)``.
    """
    pems: dict[str, bytes] = {}
    for name, path in paths.items():
        if path:
            try:
                pems[name] = Path(path).read_bytes()
            except FileNotFoundError:
                raise ValueError(f"{label.format(name)}: no file {path}") from None
    return pems
