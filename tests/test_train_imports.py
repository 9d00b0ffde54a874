"""Import structure: the package's module-level imports form no cycle, and the trainer and the
state/validation modules import each other only at module top (a function-local import that
hides a cycle is caught here).  Read from the source with ``ast``; nothing is imported."""
import ast
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# function-local imports kept on purpose: the command line answers --help and config errors
# before it imports JAX programs
LAZY = {("falcon_jax.train.cli", "falcon_jax.train.checkpoint"), ("falcon_jax.train.cli", "falcon_jax.train.mesh"),
        ("falcon_jax.train.cli", "falcon_jax.train.trainer")}
STRICT = ("falcon_jax.state", "falcon_jax.validation", "falcon_jax.train")


def _modules() -> dict[str, pathlib.Path]:
    """Module name -> source file, through pyproject's package-dir mapping."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for pkg, folder in dirs.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            out[".".join([pkg, *parts]).removesuffix(".__init__")] = f
    return out


def _imports(name: str, path: pathlib.Path, mods) -> list[tuple[str, bool]]:
    """(imported package module, at module top?) for every import of one of ``mods``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            # `from pkg import sub` imports the module pkg.sub
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        out += [(t, id(node) in top) for t in targets if t in mods]
    return out


def test_no_module_level_import_cycle():
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        # importing a sub-module first imports its parent packages: those edges are no cycle
        graph[name] = {t for t, at_top in _imports(name, path, mods)
                       if at_top and t != name and not name.startswith(t + ".")}
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert {"falcon_jax.state", "falcon_jax.validation", "falcon_jax.train.trainer",
            "falcon_jax.train.report"} <= set(graph)
    assert "falcon_jax.state" in graph["falcon_jax.validation"]  # one direction only
    assert "falcon_jax.train.report" in graph["falcon_jax.train.trainer"]


def test_trainer_and_state_modules_import_only_at_module_top():
    mods = _modules()
    local = sorted((name, t) for name, path in mods.items() if name.startswith(STRICT)
                   for t, at_top in _imports(name, path, mods) if not at_top)
    assert set(local) == LAZY, local
