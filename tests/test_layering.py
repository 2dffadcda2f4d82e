"""The module graph: no import cycles (lazy imports inside functions count), the layers point one way
(infer -> trainer -> pipeline, docs/ARCHITECTURE.md §1), and nothing edits sys.path."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "trainer", "infer", "tools")
LAYER = {"pipeline": 0, "trainer": 1, "infer": 2, "tools": 3}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Project modules `path` imports anywhere in its body (`from a.b import c` counts a.b.c when that is a
    module, else a.b)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def graph() -> dict[str, set[str]]:
    files = project_files()
    known = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, known) - {module_name(p)} for p in files}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    g = graph()
    assert len(g) > 80  # the walk found the project
    assert cycles(g) == []


def test_layers_point_one_way():
    upward = [(m, d) for m, deps in graph().items() for d in deps
              if LAYER[d.split(".")[0]] > LAYER[m.split(".")[0]]]
    assert upward == []


def test_nothing_edits_sys_path():
    offenders = [str(p.relative_to(REPO)) for p in [*project_files(), *sorted((REPO / "tests").glob("*.py"))]
                 if p != Path(__file__) and "sys.path" in p.read_text()]
    assert offenders == []
