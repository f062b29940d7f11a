"""The house's structure, read from the source (every `import`, lazy and TYPE_CHECKING ones too; nothing is imported or
run): each package on its floor, no import cycles, modules and functions of a readable size, no shims.

The floors. The root utilities (common, config, layers, device, dist, batching, console, plots) are the ground: they
import only each other. `models` (single-device model code) and `store` (the shard store) stand on the ground alone.
`artifacts` (the directories and files hstap reads and writes besides its store: model and drafter directories, the
vocabulary map, run records) stands on those two, below every stage that reads or writes them. Above it the pipeline
data -> capture -> store -> train -> export -> speculative: a stage imports only what is below it, and stages that
hand each other files (capture -> train through the store, train -> export and eval through a drafter directory)
meet in those floors, never in each other's code. `BELOW` names each package's floors, the rest follows by
transitivity; only cli and demo (and the serve loop, a composition of capture, train and eval) compose stages.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GROUND = ("hstap", "common", "config", "layers", "device", "dist", "batching", "console", "plots")
"""The root utilities: they import nothing but each other ("hstap" is the package itself: its version)."""
BELOW: dict[str, tuple[str, ...]] = {
    "models": (),
    "store": (),
    "artifacts": ("models", "store"),
    "engines": ("artifacts",),
    "data": ("artifacts",),
    "capture": ("data", "engines"),  # generate --capture composes generate; --engine sglang/vllm start the engines
    "verify": ("data",),
    "train": ("data", "verify"),  # train's pre-flight is verify's quick check
    "export": ("artifacts",),
    "speculative": ("data", "engines", "export"),  # eval reads exports and runs drafters inside the engines
    "serve_loop": ("capture", "train", "speculative"),
    "convert": ("artifacts",),
    "demo": ("capture", "train", "speculative"),
    "stage_paths": ("artifacts",),  # the outputs' writability check
    "cli": ("demo", "serve_loop", "convert", "stage_paths"),
}
"""Each package's floors directly below it (besides the ground); what it may import is their transitive closure."""
ENGINE_MODULES = ("hstap.capture.hf", "hstap.capture.sglang", "hstap.capture.vllm")
"""The capture engines: imported by the one --engine names when it runs (capture/stage.py), never by the store or by
what every engine shares (capture/inputs.py)."""
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 100


def modules(root: Path) -> dict[str, Path]:
    """hstap's modules by dotted name (a package by its own name) -> file."""
    out = {}
    for f in sorted((root / "hstap").rglob("*.py")):
        name = ".".join(f.relative_to(root).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def imported(name: str, f: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement may reach (the module, and for `from m import x` also m.x)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        parts = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def floor_of(name: str) -> str:
    """The package (or root module) a module belongs to: hstap.capture.vllm.driver -> capture, hstap.dist -> dist."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def allowed(floor: str) -> set[str]:
    """Everything a floor may import besides itself: the ground and the closure of `BELOW`."""
    out, todo = set(GROUND), list(BELOW.get(floor, ()))
    while todo:
        f = todo.pop()
        if f not in out:
            out.add(f)
            todo.extend(BELOW.get(f, ()))
    return out


def read(root: Path):
    """(modules, import edges {module: {module it imports}}, syntax trees)."""
    mods = modules(root)
    trees = {m: ast.parse(f.read_text(), str(f)) for m, f in mods.items()}
    edges: dict[str, set[str]] = {}
    for m, tree in trees.items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(m, mods[m], node):
                    parts = target.split(".")
                    for i in range(len(parts), 0, -1):  # the longest prefix that is an hstap module
                        cand = ".".join(parts[:i])
                        if cand in mods:
                            if cand != m:
                                deps.add(cand)
                            break
        edges[m] = deps
    return mods, edges, trees


def floor_violations(mods: dict[str, Path], edges: dict[str, set[str]]) -> list[str]:
    """Every import that points up a floor or sideways into another stage, every package on no floor, every engine
    module imported by the store or by capture/inputs.py."""
    bad = []
    floors = {floor_of(m) for m in mods}
    for f in sorted(floors - set(GROUND) - set(BELOW)):
        bad.append(f"hstap.{f}: on no floor (place it in BELOW or GROUND)")
    for m in sorted(edges):
        own = floor_of(m)
        for d in sorted(edges[m]):
            other = floor_of(d)
            if other != own and other not in allowed(own) and (own in BELOW or own in GROUND):
                bad.append(f"{m} imports {d} (floor {own} stands below floor {other})")
            if (own == "store" or m == "hstap.capture.inputs") and d.startswith(ENGINE_MODULES):
                bad.append(f"{m} imports the capture engine {d}")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def shape_violations(mods: dict[str, Path], trees: dict[str, ast.Module], root: Path) -> list[str]:
    """Files over MAX_FILE_LINES, functions over MAX_FUNCTION_LINES, module-level __getattr__ (a shim), a private
    `_name` imported from another hstap module."""
    bad = []
    for m, tree in sorted(trees.items()):
        rel = mods[m].relative_to(root)
        n = len(mods[m].read_text().splitlines())
        if n > MAX_FILE_LINES:
            bad.append(f"{rel}: {n} lines (> {MAX_FILE_LINES})")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    bad.append(f"{rel}:{node.lineno}: {node.name} is {length} lines (> {MAX_FUNCTION_LINES})")
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hstap")):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{rel}:{node.lineno}: imports the private {a.name}")
        if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
            bad.append(f"{rel}: a module-level __getattr__ (import a name from the module that defines it)")
    return bad


def violations(root: Path) -> list[str]:
    """Every rule of the module docstring, one line per violation."""
    mods, edges, trees = read(root)
    return (floor_violations(mods, edges) + [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
            + shape_violations(mods, trees, root))


def test_every_package_on_its_floor():
    mods, edges, _ = read(ROOT)
    assert floor_violations(mods, edges) == []


def test_no_import_cycles():
    _, edges, _ = read(ROOT)
    assert cycles(edges) == []


def test_modules_and_functions_of_a_readable_size_and_no_shims():
    mods, _, trees = read(ROOT)
    assert shape_violations(mods, trees, ROOT) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_the_check_sees_each_kind_of_violation(tmp_path):
    """A small tree breaking each rule once: the check names every break, and a tree keeping them passes."""
    ok = {"hstap/__init__.py": "", "hstap/common.py": "", "hstap/store/__init__.py": "",
          "hstap/store/format.py": "from hstap.common import x\n", "hstap/artifacts/__init__.py": "",
          "hstap/artifacts/vocab_map.py": "import hstap.store.format\n", "hstap/data/__init__.py": "",
          "hstap/data/prepare.py": "from hstap.artifacts import vocab_map\n", "hstap/capture/__init__.py": "",
          "hstap/capture/inputs.py": "from hstap.data.prepare import y\n"}
    assert violations(_tree(tmp_path / "ok", ok)) == []
    broken = ok | {
        "hstap/store/format.py": "def f():\n    from hstap.artifacts.vocab_map import m  # lazy: it counts\n",
        "hstap/artifacts/vocab_map.py": "from hstap.data import prepare\n",
        "hstap/data/prepare.py": "from hstap.data.answers import a\n",
        "hstap/data/answers.py": "from hstap.data.prepare import p\nfrom hstap.common import _private\n",
        "hstap/capture/inputs.py": "from hstap.capture.vllm import driver\n",
        "hstap/capture/vllm/__init__.py": "", "hstap/capture/vllm/driver.py": "",
        "hstap/train/__init__.py": "from hstap.capture import inputs\n",
        "hstap/gadgets/__init__.py": "def __getattr__(name):\n    return name\n",
        "hstap/export/__init__.py": "def f():\n" + "    x = 1\n" * 100 + "x = [\n" + "    0,\n" * 500 + "]\n",
    }
    got = "\n".join(violations(_tree(tmp_path / "broken", broken)))
    for expected in ("hstap.gadgets: on no floor",
                     "hstap.store.format imports hstap.artifacts.vocab_map (floor store stands below floor artifacts)",
                     "hstap.artifacts.vocab_map imports hstap.data.prepare (floor artifacts stands below floor data)",
                     "hstap.train imports hstap.capture.inputs (floor train stands below floor capture)",
                     "hstap.capture.inputs imports the capture engine hstap.capture.vllm",
                     "import cycle: hstap.data.answers <-> hstap.data.prepare",
                     "hstap/data/answers.py:2: imports the private _private",
                     "hstap/gadgets/__init__.py: a module-level __getattr__",
                     "hstap/export/__init__.py: 603 lines (> 500)",
                     "hstap/export/__init__.py:1: f is 101 lines (> 100)"):
        assert expected in got, got
