"""Regenerate the Python code of the wire contract from ``proto/edgerl/v1/*.proto``.

Usage::

    python -m edgerl.proto.generate          # rewrite proto/v1/*_pb2*.py
    python -m edgerl.proto.generate --check  # exit 1 if the checked-in code is stale

The generated modules live in ``edgerl.proto.v1``; the ``.proto`` files keep the
canonical import path ``edgerl/v1/...`` so that C++ and other clients include
them under the same name the descriptor pool and server reflection report.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SOURCE_DIR = PROTO_DIR / "edgerl" / "v1"
OUTPUT_DIR = PROTO_DIR / "v1"
_IMPORT_FROM = "from edgerl.v1 import "
_IMPORT_TO = "from edgerl.proto.v1 import "


def generate() -> dict[str, str]:
    """Run protoc and return ``{file name: contents}`` of the generated modules."""
    from grpc_tools import protoc  # dev dependency, imported only here

    sources = sorted(SOURCE_DIR.glob("*.proto"))
    if not sources:
        raise FileNotFoundError(f"no .proto files under {SOURCE_DIR}")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(s.relative_to(PROTO_DIR)) for s in sources),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        out = Path(tmp) / "edgerl" / "v1"
        return {
            p.name: p.read_text().replace(_IMPORT_FROM, _IMPORT_TO)
            for p in sorted(out.iterdir())
            if p.suffix in (".py", ".pyi")
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare instead of writing; exit 1 when the checked-in code is stale (default: off)",
    )
    args = parser.parse_args(argv)
    files = generate()
    stale = []
    for name, text in files.items():
        path = OUTPUT_DIR / name
        current = path.read_text() if path.exists() else ""
        if current == text:
            continue
        stale.append(name)
        if args.check:
            diff = difflib.unified_diff(
                current.splitlines(),
                text.splitlines(),
                f"{path} (checked in)",
                f"{path} (generated)",
                lineterm="",
                n=1,
            )
            print("\n".join(list(diff)[:40]), file=sys.stderr)
        else:
            path.write_text(text)
    if args.check and stale:
        print(
            f"stale generated code: {', '.join(stale)}; run `python -m edgerl.proto.generate`",
            file=sys.stderr,
        )
        return 1
    if not args.check:
        print(f"wrote {len(stale)} file(s) under {OUTPUT_DIR}" if stale else "generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
