#!/usr/bin/env python3
"""Fails (exit 1) when the committed ``gpurpc.v1`` stubs differ from freshly generated ones.

Run by CI: ``python3 client/python/tools/check_stubs.py``. Regenerate with
``python3 client/python/tools/generate_stubs.py`` after changing anything under proto/.
"""
from __future__ import annotations

import difflib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_stubs  # noqa: E402


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())
            if p.is_file() and p.suffix in (".py", ".pyi")}


def main() -> int:
    committed_dir = generate_stubs.STUB_DIR
    with tempfile.TemporaryDirectory(prefix="gpurpc-check-stubs-") as tmp:
        fresh_dir = Path(tmp) / "v1"
        generate_stubs.generate(fresh_dir)
        fresh = _files(fresh_dir)
    committed = _files(committed_dir) if committed_dir.is_dir() else {}
    problems = []
    for name in sorted(set(fresh) | set(committed)):
        if name not in committed:
            problems.append(f"missing: {name}")
        elif name not in fresh:
            problems.append(f"stale extra file: {name}")
        elif fresh[name] != committed[name]:
            diff = difflib.unified_diff(
                committed[name].decode(errors="replace").splitlines(),
                fresh[name].decode(errors="replace").splitlines(),
                f"committed/{name}", f"generated/{name}", lineterm="", n=1)
            problems.append(f"differs: {name}\n" + "\n".join(list(diff)[:40]))
    if problems:
        print(f"gpurpc.v1 stubs in {committed_dir} are stale (generator: grpcio-tools "
              f"{generate_stubs.GRPCIO_TOOLS_VERSION}):", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        print("Regenerate: python3 client/python/tools/generate_stubs.py", file=sys.stderr)
        return 1
    print(f"gpurpc.v1 stubs are up to date ({len(fresh)} files, grpcio-tools "
          f"{generate_stubs.GRPCIO_TOOLS_VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
