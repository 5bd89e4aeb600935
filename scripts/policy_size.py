"""The draft policy's size: lines of edge_worker/policy/*.py and its named module-level constants (an UPPER_CASE
name assigned at module level). Prints `lines=N constants=M`."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "edge_worker" / "policy"
lines = constants = 0
for path in sorted(ROOT.glob("*.py")):
    text = path.read_text()
    lines += len(text.splitlines())
    for node in ast.parse(text).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        constants += sum(isinstance(t, ast.Name) and t.id.isupper() and not t.id.startswith("__") for t in targets)
print(f"lines={lines} constants={constants}")
