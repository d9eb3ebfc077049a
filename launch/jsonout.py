"""The JSON that edgerl's commands print and write: summaries, benchmark results, bag info.

A figure that could not be measured (a latency percentile of a robot that never got an answer,
a rate over no time) is NaN inside edgerl. Python's ``json`` would write it as ``NaN``, which is
no JSON: ``jq``, JavaScript and most other readers refuse the whole document. Here it is
``null``, as are infinities; numpy scalars and arrays become plain numbers and lists.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


def plain(obj: Any) -> Any:
    """``obj`` with every non-finite float as ``None``, numpy values as Python ones and tuples
    as lists: what :func:`json.dumps` writes as standard JSON."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return plain(obj.tolist())
    if isinstance(obj, np.generic):
        return plain(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps(obj: Any, *, indent: int | None = None) -> str:
    """``obj`` as standard JSON (see :func:`plain`).

    Raises:
        TypeError: ``obj`` holds a value JSON has no form for.
    """
    return json.dumps(plain(obj), indent=indent, allow_nan=False)


def write_json(obj: Any, path: str) -> None:
    """``obj`` as indented standard JSON in the file at ``path``, with a final newline."""
    with open(path, "w") as f:
        f.write(dumps(obj, indent=2) + "\n")
