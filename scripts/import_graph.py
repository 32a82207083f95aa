"""The import graph of `retention/` from its source (AST), for a closing note's figures.

    python scripts/import_graph.py [ROOT]

Prints the modules and import edges, module cycles, the arrows between packages (`api.py` its own
room), the two-way package pairs (arrows back up) and package cycles, the two-way pairs inside
`runs/`, `runtime/`, `policy/`, between `runs/` and its subpackages, and any import of the runtime
into the packages above it. Imports under `if TYPE_CHECKING:` are skipped; function-level ones
count. `tests/test_imports.py` holds the same rules as tests.
"""
import ast, sys
from pathlib import Path
ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
mods = {}
for p in sorted((ROOT / "retention").rglob("*.py")):
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    mods[".".join(parts)] = p
def tgt(name):
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None
edges = {m: set() for m in mods}
for m, p in mods.items():
    tree = ast.parse(p.read_text())
    pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
    def walk(node):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.If) and getattr(ch.test, "id", getattr(ch.test, "attr", "")) == "TYPE_CHECKING":
                for c in ch.orelse: walk(c)
                continue
            if isinstance(ch, ast.Import):
                for a in ch.names:
                    t = tgt(a.name); t and edges[m].add(t)
            elif isinstance(ch, ast.ImportFrom):
                base = ch.module or ""
                if ch.level:
                    b = pkg.split(".")[: len(pkg.split(".")) - ch.level + 1]
                    base = ".".join(b + ([ch.module] if ch.module else []))
                for a in ch.names:
                    t = tgt(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else tgt(base)
                    t and edges[m].add(t)
            walk(ch)
    walk(tree)
    edges[m].discard(m)
def scc(g):
    idx, low, st, on, out, i = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)
    def sc(v):
        idx[v] = low[v] = i[0]; i[0] += 1; st.append(v); on.add(v)
        for w in g[v]:
            if w not in idx: sc(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], idx[w])
        if low[v] == idx[v]:
            c = []
            while True:
                w = st.pop(); on.discard(w); c.append(w)
                if w == v: break
            if len(c) > 1: out.append(sorted(c))
    for v in g:
        if v not in idx: sc(v)
    return out
print("modules:", len(mods), "edges:", sum(len(v) for v in edges.values()))
print("module cycles (SCCs):", scc(edges))
def room(m):
    parts = m.split(".")
    if m == "retention.api": return "api"
    return parts[1] if len(parts) > 1 and (ROOT / "retention" / parts[1]).is_dir() else "(root)"
pg = {}
for m, ts in edges.items():
    for t in ts:
        a, b = room(m), room(t)
        if a != b: pg.setdefault(a, set()).add(b)
rooms = sorted({room(m) for m in mods})
for r in rooms: pg.setdefault(r, set())
print("package arrows:", {k: sorted(v) for k, v in sorted(pg.items())})
print("package arrows count:", sum(len(v) for v in pg.values()))
two = sorted({tuple(sorted((a, b))) for a in pg for b in pg[a] if a in pg.get(b, ())})
print("package two-way pairs (arrows back up):", two)
print("package cycles (SCCs):", scc(pg))
for pkgname in ("runs", "runtime", "policy", "scorers"):
    sub = {m: {t for t in ts if t.startswith(f"retention.{pkgname}")} for m, ts in edges.items() if m.startswith(f"retention.{pkgname}")}
    pairs = sorted({tuple(sorted((a, b))) for a in sub for b in sub[a] if a in sub.get(b, ())})
    print(f"two-way module pairs in {pkgname}:", pairs)
bad = [(m, t) for m, ts in edges.items() if m.startswith("retention.runtime") for t in ts
       if t.split(".")[1:2] and t.split(".")[1] in ("scorers", "models", "policy")]
print("runtime -> scorers/models/policy:", bad)
def sub(m):
    parts = m.split(".")
    if len(parts) > 2 and parts[1] == "runs" and (ROOT / "retention" / "runs" / parts[2]).is_dir():
        return "runs." + parts[2]
    return "runs" if len(parts) > 1 and parts[1] == "runs" else None
sp = {}
for m, ts in edges.items():
    a = sub(m)
    if a is None: continue
    for t in ts:
        b = sub(t)
        if b and b != a: sp.setdefault(a, set()).add(b)
print("runs sub-package arrows:", {k: sorted(v) for k, v in sp.items()})
print("runs sub-package two-way pairs:", sorted({tuple(sorted((a, b))) for a in sp for b in sp[a] if a in sp.get(b, ())}))
conf = [(m, t) for m, ts in edges.items() if m.startswith("retention.runs.conformance") for t in ts if t.startswith("retention.runs.conformance")]
print("conformance edges:", conf)
