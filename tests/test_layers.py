"""The package's layers point down: a module imports only its own layer and those below.

The layers are docs/architecture.md's; a module's layer is that of the longest
prefix listed for it. Imports inside functions count too: a lazy import is an
import all the same.
"""
import ast
import os

import pytest

import autodist

LAYERS = (
    ("representation", ("autodist.proto", "autodist.partition", "autodist.graph_item",
                        "autodist.gradient_seeds", "autodist.graph_defs", "autodist.cross_replica",
                        "autodist.resource_spec", "autodist.network", "autodist.kernel_context",
                        "autodist.strategy.base", "autodist.usage", "autodist._tf_compat",
                        "autodist._keras_compat", "autodist._startup", "autodist.const")),
    ("builders", ("autodist.strategy",)),
    ("synchronizer kinds", ("autodist.synchronizers",)),
    ("compile", ("autodist.strategy.compiler",)),
    ("kernels", ("autodist.kernels",)),
    ("session and runtime", ("autodist.session", "autodist.checkpoint", "autodist.cluster",
                             "autodist.keras")),
    ("search", ("autodist.simulator", "autodist.search")),
    ("front and command line", ("autodist.autodist", "autodist.cli", "autodist")),
)
PACKAGE = os.path.dirname(autodist.__file__)


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix of ``module``."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact_only = prefix == "autodist"  # the package itself, not everything in it
            matches = module == prefix or (not exact_only and module.startswith(prefix + "."))
            if matches and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} is in no layer; add it to LAYERS and docs/architecture.md"
    return best


def modules() -> dict:
    """Module name -> its source path, for every module of the package but generated ones."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py") or name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(path: str, known: dict) -> set:
    """The package's modules ``path`` imports (``from a import b`` is ``a.b`` when that is one)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else node.module)
    return {name for name in names if name == "autodist" or name.startswith("autodist.")}


def test_every_import_points_down_or_sideways():
    known = modules()
    upward = []
    for module, path in sorted(known.items()):
        here = layer_of(module)
        for target in sorted(imported(path, known)):
            if layer_of(target) > here:
                upward.append(f"{module} ({LAYERS[here][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "\n".join(upward)


def test_the_check_finds_an_upward_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from autodist.kernels import transformer\n")
    known = {"autodist.kernels.transformer": ""}
    assert imported(str(source), known) == {"autodist.kernels.transformer"}
    assert layer_of("autodist.kernels.transformer") > layer_of("autodist.strategy.compiler")
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("autodist.elsewhere")


def test_every_layer_is_in_the_architecture_doc():
    doc = open(os.path.join(os.path.dirname(PACKAGE), "docs", "architecture.md")).read()
    missing = [name for name, _ in LAYERS if name not in doc]
    assert not missing, missing
