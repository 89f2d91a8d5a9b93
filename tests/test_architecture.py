"""The package's layers point one way: comm <- methods <- cluster <- runner.

Each module of `distlion` is placed in a layer; it may import from its own group and from groups in
lower layers only (so `DistributedLion` in `optim`, beside the cluster backends, cannot import them).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "distlion"
# (layer, group) by module prefix; the longest prefix wins.
LAYERS = {
    "distlion.flat": (0, "flat"),
    "distlion.seeding": (0, "seeding"),
    "distlion.device": (0, "device"),  # train.device, cluster.dist_backend: what every layer places tensors by
    "distlion.amp": (0, "amp"),
    "distlion.kernels": (0, "kernels"),
    "distlion.tasks": (0, "tasks"),
    "distlion.comm": (1, "comm"),
    "distlion.methods": (2, "methods"),
    "distlion.cluster": (3, "cluster"),
    "distlion.optim": (3, "optim"),
    "distlion": (4, "runner"),  # config, runio, train, report, experiment, api, schedule, loggers
}


def place(module: str) -> tuple[int, str]:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str) -> set[str]:
    """The distlion modules a source file imports (absolute imports, at any depth of the file)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("distlion")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distlion"):
            found.add(node.module)
    return found


def upward_imports(sources: dict[str, str]) -> list[str]:
    """'importer -> imported' for every import of a higher layer, or of another group of the same layer."""
    bad = []
    for importer, source in sources.items():
        layer, group = place(importer)
        for target in sorted(imported_modules(source)):
            target_layer, target_group = place(target)
            if target_group != group and target_layer >= layer:
                bad.append(f"{importer} -> {target}")
    return bad


def test_no_module_imports_from_a_layer_above_it():
    sources = {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert len(sources) > 30 and "distlion.methods.step" in sources
    assert upward_imports(sources) == []


def test_the_checker_finds_an_upward_import():
    sources = {
        "distlion.comm.packing": "from distlion.methods.base import Method\n",
        "distlion.optim": "def f():\n    import distlion.cluster.torchdist\n",
        "distlion.methods.dlion": "from distlion.comm.packing import pack_bits\n",
    }
    assert upward_imports(sources) == [
        "distlion.comm.packing -> distlion.methods.base",
        "distlion.optim -> distlion.cluster.torchdist",
    ]
