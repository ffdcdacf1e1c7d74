"""rtkernels/ has no import cycle: module-level imports between its modules form a DAG (imports
inside functions are deferred on purpose and not counted).  A cycle makes import order matter and
hides half-initialized modules; this keeps the package readable top-down."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "rtkernels"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _module_level_imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    stack = list(ast.parse(path.read_text()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in mods:
                    out.add(target)
                elif base in mods:
                    out.add(base)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        stack.extend(ast.iter_child_nodes(node))
    out.discard(name)
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def test_no_import_cycles():
    mods = _modules()
    edges = {m: _module_level_imports(m, p, mods) for m, p in mods.items()}
    assert len(mods) > 20 and edges["rtkernels.ops.attention"], "the scan found the package"
    assert _cycles(edges) == []


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
