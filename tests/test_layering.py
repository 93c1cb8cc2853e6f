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
