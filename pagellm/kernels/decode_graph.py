"""A decode step's decoder layers in one ctypes call (``decode_graph.c``), the CPU's counterpart of a
captured CUDA graph: the same kernels, arguments and order as the Python layers, without ~4 ms of
Python per step. ``worker/decode_graph.py`` decides when a model and a step can take it and builds
the tables; this module owns the C interface and checks what it is given.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from pagellm import kernels

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES: kernels.Signatures = {
    "decode_graph_num_fields": (ctypes.c_int, []),
    "decode_graph_workspace": (_I, [_P, _I]),
    "decode_graph_run": (ctypes.c_int, [_P, _P, _P, _I, _F, _F, _P, _P, _P, _P, _P, _P, _I, _I, _P, _I, _P]),
}
# The order of decode_graph.c's enums.
FNS = ("gemm_int8", "gemm_float32", "gemm_quantized", "gemm_bfloat16", "gemm_bfloat16_amx",
       "rms_norm", "rotary", "silu_and_mul", "write_kv", "decode", "rms_norm_heads", "gelu_and_mul",
       "decode_windowed")
DIMS = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size", "cache_et", "rope_tables")
# A projection (``Linear.gemm_descriptor``): the GEMM kind, packed weight, bias (0: none), bits (int8),
# and for float32 the quantized copy batches of up to q_max_rows rows read (0: none); for int8,
# q_ptr is the int64 [k] input order its blocks were packed in (GPTQ's act-order; 0: none).
W_FIELDS = ("kind", "ptr", "bias", "bits", "q_ptr", "q_bits", "q_max_rows")
GEMM_KINDS = ("int8", "float32", "bfloat16", "bfloat16_amx")  # kind = index; its kernel is FNS' "gemm_<kind>"
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# (pre/post_ff_norm: Gemma's block, 0 in Llama's; q/k_norm: 0 for none; rope: the layer's cos/sin table;
# window: 0 for none; softcap: its float32 bits, 0 for none; act: ACTIVATIONS' index; kv_group: which
# of the step's slot rows and block tables the layer's KV cache group is, 0 where all share one.)
LAYER_FIELDS = (("in_norm", "post_norm") + tuple(f"{p}_{f}" for p in PROJECTIONS for f in W_FIELDS)
                + ("key_cache", "value_cache", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm", "rope", "window",
                   "softcap", "act", "kv_group"))
ACTIVATIONS = ("silu_and_mul", "gelu_and_mul")
# The kernels a layer calls only where its row says so.
_OPTIONAL_FNS = ("rms_norm_heads", "gelu_and_mul", "decode_windowed", "silu_and_mul")


def _gemm_fns(kind: int) -> list[int]:
    """The ``FNS`` entries a projection of this kind may call (float32: also its quantized copy's)."""
    names = [f"gemm_{GEMM_KINDS[kind]}"] + (["gemm_quantized"] if GEMM_KINDS[kind] == "float32" else [])
    return [FNS.index(n) for n in names]


_checked: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL | None:
    global _checked
    if _checked is not None:  # (run calls this every decode step: the tables are compared once)
        return _checked
    lib = kernels.load("decode_graph", SIGNATURES)
    if lib is None:
        return None
    expected = len(FNS) * 10000 + len(DIMS) * 100 + len(LAYER_FIELDS)
    if lib.decode_graph_num_fields() != expected:  # the Python tables and the C enums disagree
        raise RuntimeError("decode_graph.c and decode_graph.py disagree on their tables")
    _checked = lib
    return lib


def enabled() -> bool:
    """Whether decode steps may run as one call: ``PAGELLM_DECODE_GRAPH=0`` says no (the layers then
    run one op at a time, as they always do for prefill)."""
    return os.environ.get("PAGELLM_DECODE_GRAPH", "1") != "0" and _lib() is not None


@dataclass(slots=True)
class DecodeGraph:
    """The tables of one model's decoder layers (kernel addresses, sizes, per-layer weight and cache
    pointers), run over a decode step's rows by :meth:`run`. Whoever builds it keeps the tensors the
    pointers point into alive (``keep``) and never replaces them."""

    fns: torch.Tensor     # int64 [len(FNS)]
    dims: torch.Tensor    # int64 [len(DIMS)]
    layers: torch.Tensor  # int64 [num_layers, len(LAYER_FIELDS)]; the cache columns filled by bind_caches
    eps: float
    scale: float
    keep: list[torch.Tensor]
    cache_ptrs: tuple[int, ...] = ()
    # The caches the kernels in ``fns`` were chosen for: any others must look the same.
    cache_dtype: torch.dtype | None = None
    cache_shape: tuple[int, ...] = ()
    rope_keys: tuple[str | None, ...] = (None,)  # the models' rotary table of each cos/sin index
    block_size: int = 0  # (from dims)
    hidden: int = 0
    head_dim: int = 0
    # The list last bound: the worker hands the same list of the same views every step, whose
    # pointers need not be read again (a list whose first cache moved is read again).
    bound: list | None = None

    def __post_init__(self) -> None:
        if self.fns.shape != (len(FNS),) or self.dims.shape != (len(DIMS),) \
                or self.layers.dim() != 2 or self.layers.shape[1] != len(LAYER_FIELDS):
            raise ValueError("decode graph tables of the wrong shape")
        for t in (self.fns, self.dims, self.layers):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError("decode graph tables must be contiguous int64")
        kinds = self.layers[:, [LAYER_FIELDS.index(f"{p}_kind") for p in PROJECTIONS]].unique().tolist()
        if any(k not in range(len(GEMM_KINDS)) for k in kinds):
            raise ValueError(f"unknown GEMM kinds in {kinds}")
        needed = [FNS.index(n) for n in FNS if not n.startswith("gemm_") and n not in _OPTIONAL_FNS]
        needed += [i for k in kinds for i in _gemm_fns(k)]
        column = {name: self.layers[:, LAYER_FIELDS.index(name)] for name in ("q_norm", "window", "softcap", "act")}
        needed += [FNS.index(ACTIVATIONS[a]) for a in column["act"].unique().tolist()]
        if bool((column["q_norm"] != 0).any()):
            needed.append(FNS.index("rms_norm_heads"))
        if bool(((column["window"] != 0) | (column["softcap"] != 0)).any()):
            needed.append(FNS.index("decode_windowed"))
        if not bool((self.fns[needed] != 0).all()):
            raise ValueError("a decode graph needs the address of every kernel its layers call")
        rope = self.layers[:, LAYER_FIELDS.index("rope")]
        if bool(((rope < 0) | (rope >= int(self.dims[DIMS.index("rope_tables")]))).any()):
            raise ValueError("a layer's rope table is not one of the graph's")
        self.hidden, self.head_dim, self.block_size = (int(self.dims[DIMS.index(n)])
                                                       for n in ("hidden", "head_dim", "block_size"))

    def bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point the layers at their K/V caches (cheap when they are the ones already bound)."""
        if kv_caches is self.bound and kv_caches and kv_caches[0][0].data_ptr() == self.cache_ptrs[0]:
            return
        ptrs = tuple(t.data_ptr() for kv in kv_caches for t in kv)
        if ptrs == self.cache_ptrs:
            self.bound = kv_caches
            return
        if len(kv_caches) != self.layers.shape[0]:
            raise ValueError(f"{len(kv_caches)} K/V caches for {self.layers.shape[0]} layers")
        first = kv_caches[0][0]
        if self.cache_dtype is None:
            self.cache_dtype, self.cache_shape = first.dtype, tuple(first.shape)
        if any(t.dtype != self.cache_dtype or tuple(t.shape) != self.cache_shape or not t.is_contiguous()
               for kv in kv_caches for t in kv):
            raise ValueError(f"every K/V cache must be contiguous {self.cache_dtype} {self.cache_shape}, "
                             "as when the graph was captured")
        col = LAYER_FIELDS.index("key_cache")
        self.layers[:, col] = torch.tensor(ptrs[0::2], dtype=torch.int64)
        self.layers[:, col + 1] = torch.tensor(ptrs[1::2], dtype=torch.int64)
        self.cache_ptrs = ptrs
        self.bound = kv_caches

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over ``x [T, hidden]`` (the embedded tokens, one decode per row); returns
        ``(the last layer's output, the residual stream)`` as the Python layers do. ``x`` becomes
        the residual stream in place. ``cos / sin [rope_tables, T, head_dim]`` (each layer reads its
        table), ``slot_mapping [T]``, ``block_tables [T, max_blocks]``, ``seq_lens [T]``: contiguous,
        as the kernels take them. Where layers belong to several KV cache groups (the ``kv_group``
        column), ``slot_mapping [G, T]`` and ``block_tables [G, T, max_blocks]``, each group's rows
        contiguous (the groups may lie apart: a view of the persistent batch's tables)."""
        lib = _lib()
        assert lib is not None, "check enabled() first"
        t, hidden, head_dim = x.shape[0], self.hidden, self.head_dim
        tables = int(self.dims[DIMS.index("rope_tables")])
        if x.dtype != torch.float32 or x.shape != (t, hidden) or not x.is_contiguous():
            raise ValueError(f"x must be contiguous float32 [T, {hidden}], got {x.dtype} {tuple(x.shape)}")
        groups = int(self.layers[:, LAYER_FIELDS.index("kv_group")].max()) + 1
        slots_shape = (t,) if groups == 1 else (groups, t)
        for v, shape, dtype, name in ((cos, (tables, t, head_dim), torch.float32, "cos"),
                                      (sin, (tables, t, head_dim), torch.float32, "sin"),
                                      (slot_mapping, slots_shape, torch.int64, "slot_mapping"),
                                      (seq_lens, (t,), torch.int64, "seq_lens")):
            if v.dtype != dtype or v.shape != shape or not v.is_contiguous():
                raise ValueError(f"{name} must be contiguous {dtype} {shape}, got {v.dtype} {tuple(v.shape)}")
        per_group = block_tables if block_tables.dim() == 3 else block_tables[None]
        if block_tables.dtype != torch.int64 or per_group.dim() != 3 or per_group.shape[:2] != (groups, t) \
                or not per_group[0].is_contiguous():
            raise ValueError(f"block_tables must be int64 [{t}, max_blocks] per group ({groups}), each contiguous")
        if not self.cache_ptrs:
            raise ValueError("bind_caches() first")
        ws = torch.empty(lib.decode_graph_workspace(self.dims.data_ptr(), t))
        offset = ctypes.c_int64(0)
        status = lib.decode_graph_run(self.fns.data_ptr(), self.dims.data_ptr(), self.layers.data_ptr(),
                                      self.layers.shape[0], self.eps, self.scale, x.data_ptr(), ws.data_ptr(),
                                      cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(), per_group.data_ptr(),
                                      per_group.shape[2], per_group.stride(0), seq_lens.data_ptr(), t,
                                      ctypes.byref(offset))
        if status != 0:
            raise MemoryError("a kernel of the decode graph could not allocate its scratch memory")
        return ws[offset.value:offset.value + t * hidden].view(t, hidden), x
