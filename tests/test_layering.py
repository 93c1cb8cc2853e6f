"""Imports point down the layers (ARCHITECTURE.md) and core/ never touches torch."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "pagellm"

# layer of each top-level module / subpackage
LAYER = {
    "utils": 0, "config": 0, "sampling_params": 0, "outputs": 0, "metrics": 0, "lora_request": 0, "mm_inputs": 0,
    "reasoning": 0, "pooling_params": 0, "scoring": 0,
    "sequence": 1, "beam_state": 1,
    "core": 2, "spec_decode": 2,
    "attention": 2.5, "distributed": 2.5, "kernels": 2.5, "layers": 2.5, "models": 2.5, "weights": 2.5, "sampling": 2.5,
    "quantization": 2.5, "mapped_files": 2.5,
    "lora": 2.5,
    "worker": 3, "executor": 4,
    "tokenizer": 5, "detokenizer": 5, "engine": 5, "structured_output": 5,
    "entrypoints": 6, "__init__": 6,
}
# Allowed imports per layer, beyond the module's own layer.
ALLOWED = {
    0: {0}, 1: {0, 1}, 2: {0, 1, 2},
    2.5: {0, 2.5},  # models see tensors, never sequences or the scheduler
    # (the scheduler's step, and the KV cache groups' specs: plain data the worker lays its cache out by)
    3: {0, 2.5, 3, "core.scheduler_output", "core.kv_cache_spec"},
    4: {0, 3, 4, "core.scheduler_output"},
    5: {0, 1, 2, 4, 5},
    6: {0, 1, 2, 4, 5, 6},
}
TORCH_FREE = {0, 1, 2}
# The model side (layer 2.5) in order: a package imports only those before it (and itself).
# mapped_files (a checkpoint's mapped bytes) sits with the kernels: the stored formats read rows through it.
MODEL_SIDE_ORDER = {"kernels": 0, "mapped_files": 0, "quantization": 1, "distributed": 1, "layers": 2,
              "attention": 3, "sampling": 3, "lora": 3, "models": 4, "weights": 5}


def _modules():
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("")
        yield path, rel.parts


def _is_module(dotted: str) -> bool:
    """Whether ``pagellm.a.b`` names a module or package of ours (not a name defined in one)."""
    p = PKG.joinpath(*dotted.split(".")[1:])
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _imports(path: Path, source: str | None = None) -> list[str]:
    """Every module ``path`` imports, ours resolved to ``pagellm.<module>``: relative imports
    against its package, ``from pagellm(.pkg) import X`` to the submodule X where X is one, else to
    the package's ``__init__`` (``pagellm.__init__`` for ``from pagellm import LLM``)."""
    tree = ast.parse(source if source is not None else path.read_text())
    package = ["pagellm", *path.relative_to(PKG).parts[:-1]]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            if mod != "pagellm" and not (mod.startswith("pagellm.") and _is_module(mod)):
                out.append(mod)
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.append(sub if _is_module(sub) else f"{mod}.__init__" if mod == "pagellm" else mod)
    return out


def test_every_module_has_a_layer():
    for _, parts in _modules():
        assert parts[0] in LAYER, f"pagellm/{'/'.join(parts)}.py is in no layer: add it to LAYER and ARCHITECTURE.md"


def test_imports_point_down():
    bad = []
    for path, parts in _modules():
        layer = LAYER[parts[0]]
        for mod in _imports(path):
            if not mod.startswith("pagellm."):
                if layer in TORCH_FREE and mod.split(".")[0] in ("torch", "numpy", "transformers"):
                    bad.append(f"{'/'.join(parts)} imports {mod} (layer {layer} is pure Python)")
                continue
            target = mod.split(".")[1]
            sub = ".".join(mod.split(".")[1:3])
            tl = LAYER[target]
            if tl == layer or tl in ALLOWED[layer] or sub in ALLOWED[layer]:
                continue
            bad.append(f"{'/'.join(parts)} (layer {layer}) imports {mod} (layer {tl})")
    assert not bad, "\n".join(bad)


def _model_side_violations(edges: list[tuple[str, str]]) -> list[str]:
    bad = []
    for src, mod in edges:
        a, b = src.split("/")[0], mod.split(".")[1]
        if a in MODEL_SIDE_ORDER and b in MODEL_SIDE_ORDER and a != b and MODEL_SIDE_ORDER[b] >= MODEL_SIDE_ORDER[a]:
            bad.append(f"{src} (model side {MODEL_SIDE_ORDER[a]}) imports {mod} (model side {MODEL_SIDE_ORDER[b]})")
    return bad


def _edges() -> list[tuple[str, str]]:
    return [("/".join(parts), mod) for path, parts in _modules() for mod in _imports(path)
            if mod.startswith("pagellm.")]


def test_the_model_side_is_ordered():
    """kernels < quantization, distributed < layers < attention, sampling, lora < models < weights:
    a weight format or an op never reaches up into a model, nor a model into checkpoint loading."""
    assert set(MODEL_SIDE_ORDER) == {k for k, v in LAYER.items() if v == 2.5}
    bad = _model_side_violations(_edges())
    assert not bad, "\n".join(bad)


def test_weights_know_no_model():
    """Checkpoint reading (``weights/``) takes its families' layouts from its own tables
    (``gguf_file.GGUF_FAMILIES``), not from the models: the two meet in the worker."""
    bad = [f"{src} imports {mod}" for src, mod in _edges() if src.startswith("weights/") and
           mod.split(".")[1] == "models"]
    assert not bad, bad


def test_the_ordered_rule_fails_on_an_import_against_the_order():
    planted = [("layers/linear", "pagellm.models.decoder"), ("quantization/gguf_quant", "pagellm.layers.linear"),
               ("models/decoder", "pagellm.weights.loader"), ("layers/norm", "pagellm.attention.metadata")]
    assert len(_model_side_violations(planted)) == 4
    assert not _model_side_violations([("models/decoder", "pagellm.layers.linear"),
                                       ("layers/linear", "pagellm.quantization.weight_formats")])


def test_the_import_resolver_sees_package_and_relative_imports():
    """The rule above would be blind to ``from pagellm import LLM`` (the entry layer, through
    ``__init__``) and to relative imports; both resolve to the module they load."""
    core = PKG / "core" / "scheduler.py"
    assert _imports(core, "from pagellm import LLM") == ["pagellm.__init__"]
    assert _imports(core, "from pagellm import kernels") == ["pagellm.kernels"]
    assert _imports(core, "from ..worker import cache_engine") == ["pagellm.worker.cache_engine"]
    assert _imports(core, "from .block_pool import BlockPool") == ["pagellm.core.block_pool"]
    assert _imports(core, "from . import block_pool") == ["pagellm.core.block_pool"]
    gemm = PKG / "kernels" / "gemm.py"
    assert _imports(gemm, "from pagellm.kernels import gemm_int8") == ["pagellm.kernels.gemm_int8"]


def _load_time_imports(path: Path) -> list[str]:
    """The modules ``path`` imports when it is loaded: module-level statements only (not inside a
    function, not under ``if TYPE_CHECKING``), resolved as ``_imports`` does."""
    tree = ast.parse(path.read_text())
    kept: list[ast.stmt] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                kept.append(node)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody)

    visit(tree.body)
    return _imports(path, "\n".join(ast.unparse(n) for n in kept))


def _path_of(mod: str) -> Path:
    p = PKG.joinpath(*mod.split(".")[1:])
    return p / "__init__.py" if (p / "__init__.py").exists() else p.with_suffix(".py")


def _load_closure(*roots: str) -> tuple[set[str], set[str]]:
    """(our modules, third-party top-level packages) that importing ``roots`` loads."""
    ours, theirs, todo = set(), set(), list(roots)
    while todo:
        mod = todo.pop()
        if mod in ours:
            continue
        ours.add(mod)
        parts = mod.split(".")
        todo += [".".join(parts[:i]) + ".__init__" for i in range(1, len(parts))]  # its packages run first
        path = _path_of(mod.removesuffix(".__init__"))
        if not path.exists():  # a namespace package: nothing runs
            continue
        for dep in _load_time_imports(path):
            if dep.startswith("pagellm.") or dep == "pagellm":
                todo.append(dep if dep != "pagellm" else "pagellm.__init__")
            else:
                theirs.add(dep.split(".")[0])
    return ours, theirs


# What the HTTP front end over an engine core process may not load: the model side of the package,
# and torch (transformers, which loads torch whenever it can, only in a process that keeps torch out).
MODEL_SIDE = {"attention", "distributed", "kernels", "layers", "models", "weights", "sampling", "lora", "worker",
              "executor", "spec_decode", "structured_output"}


def test_the_http_front_end_loads_no_torch_and_no_model_code():
    ours, theirs = _load_closure("pagellm.entrypoints.cli", "pagellm.entrypoints.openai_server",
                                 "pagellm.engine.core_client")
    model_side = sorted(m for m in ours if m.split(".")[1] in MODEL_SIDE)
    assert not model_side, f"the front end loads model code: {model_side}"
    assert not theirs & {"torch", "transformers", "triton"}, sorted(theirs & {"torch", "transformers", "triton"})
    assert {"pagellm.engine.protocol", "pagellm.engine.core_messages"} <= ours  # (the closure is followed)


def test_the_load_closure_follows_module_level_imports_only():
    """The rule above would be blind if it stopped at the first module or counted lazy imports."""
    ours, theirs = _load_closure("pagellm.engine.async_llm")
    assert "torch" in theirs and "pagellm.worker.worker" in ours  # through llm_engine and the executor
    protocol = PKG / "engine" / "protocol.py"  # its pagellm imports are all under TYPE_CHECKING
    assert "pagellm.outputs" in _imports(protocol)
    assert not [m for m in _load_time_imports(protocol) if m.startswith("pagellm")]


def test_the_serving_modules_see_the_engine_through_its_protocol_only():
    """``serving_*`` take any ``EngineClient`` (in-process or over the core process): of ``engine/``
    they import ``engine/protocol.py`` alone."""
    serving = sorted((PKG / "entrypoints").glob("serving_*.py"))
    assert len(serving) >= 6
    bad = [f"{p.name} imports {m}" for p in serving for m in _imports(p)
           if m.startswith("pagellm.engine") and m != "pagellm.engine.protocol"]
    assert not bad, bad


def _runtime_imports(path: Path) -> list[str]:
    """Every import ``path`` can run, at load time or in a function: all but ``if TYPE_CHECKING``'s."""
    tree = ast.parse(path.read_text())

    class DropTypeChecking(ast.NodeTransformer):
        def visit_If(self, node: ast.If) -> ast.AST | None:
            return None if "TYPE_CHECKING" in ast.unparse(node.test) else self.generic_visit(node)

    kept = [n for n in ast.walk(DropTypeChecking().visit(tree)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return _imports(path, "\n".join(ast.unparse(n) for n in kept))


def _import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a path that returns to its start), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n, [n]))), None)


def test_no_import_circle_but_type_checking_ones():
    """No two modules import each other, even lazily from a function (a registry that imports its
    implementations while they import its base classes is a circle): only type hints may."""
    graph: dict[str, set[str]] = {}
    for path, parts in _modules():
        src = ".".join(["pagellm", *parts]).removesuffix(".__init__")
        graph[src] = {m.removesuffix(".__init__") for m in _runtime_imports(path) if m.startswith("pagellm.")}
    assert _import_cycle(graph) is None, _import_cycle(graph)
    assert _import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # (the finder finds one)
