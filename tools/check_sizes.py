"""Line budget: every library file under 400 lines, every function under 60 lines."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE = 400
MAX_FUNC = 60


def main() -> int:
    root = Path(__file__).resolve().parents[1] / "src" / "kvbridge"
    bad = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_FILE:
            bad.append(f"{path}: {len(lines)} lines > {MAX_FILE}")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNC:
                    bad.append(f"{path}:{node.lineno}: {node.name} has {n} lines > {MAX_FUNC}")
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
