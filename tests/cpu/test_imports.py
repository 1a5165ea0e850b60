"""The package's modules import each other without a cycle (every import statement, those
inside functions too: a lazy import is still a dependency), and importing the package touches
no GPU and no process group."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "megatron_dist_moe"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("megatron_dist_moe")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("megatron_dist_moe"):
                out.add(mod)
                out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def test_no_import_cycle():
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {m: {d for d in _imports(p, m) if d in modules and d != m}
             for m, p in modules.items()}
    # a module's parent packages are imported before it: include those edges
    for m in list(graph):
        parts = m.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in graph and parent != m:
                graph[m].add(parent)
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycle = stack[stack.index(d):] + [d]
                # a package importing its own submodule in __init__ is not a cycle of concern
                # (whichever member the walk entered the cycle by)
                root = min(cycle, key=len)
                if not all(c.startswith(root) for c in cycle):
                    raise AssertionError("import cycle: " + " -> ".join(cycle))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_import_touches_no_gpu():
    code = ("import megatron_dist_moe, torch, sys; "
            "assert not torch.cuda.is_initialized(); "
            "import torch.distributed as d; assert not d.is_initialized(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
