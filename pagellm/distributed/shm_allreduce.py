"""All-reduce (and all-gather) through shared memory for tensor-parallel ranks on one machine
(``shm_allreduce.c``).

gloo sends every all-reduce over loopback TCP: ~0.5 ms even for one row, and a tensor-parallel
step of SmolLM2 does 62 of them. Ranks that share a machine can instead exchange through one
shared-memory segment (what vLLM's CPU backend does). Used for contiguous float32 CPU tensors
when every rank runs on the same host; anything else, or ``PAGELLM_SHM_ALLREDUCE=0``, stays on
``torch.distributed``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets

import torch
import torch.distributed as dist

from pagellm import kernels

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES: kernels.Signatures = {
    "shm_all_reduce_f32": (_I, [_P, _P, _I, _I, _I, _I, _I, ctypes.c_double]),
    "shm_all_gather_f32": (_I, [_P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_double]),
}
CHUNK = 1 << 20  # floats per rank and buffer: 4 MiB, a 2048-token step of a 512-wide model at once
TIMEOUT_S = 600.0


def enabled() -> bool:
    return os.environ.get("PAGELLM_SHM_ALLREDUCE", "1") != "0"


def _host_id() -> str:
    """This machine (hostname alone can repeat across containers; the boot id does not)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


class ShmAllReduce:
    """One shared segment per tensor-parallel group; created by rank 0, mapped by all, and
    unlinked as soon as everyone has it (so a crash leaves nothing in ``/dev/shm``)."""

    def __init__(self, rank: int, world_size: int, name: str, chunk: int = CHUNK) -> None:
        lib = kernels.load("shm_allreduce", _SIGNATURES)
        if lib is None:
            raise RuntimeError("the shared-memory all-reduce kernel is unavailable")
        self._reduce, self._gather = lib.shm_all_reduce_f32, lib.shm_all_gather_f32
        self.rank, self.world_size, self.chunk = rank, world_size, chunk
        size = 64 * world_size + 2 * world_size * chunk * 4
        path = f"/dev/shm/{name}"
        if rank == 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)  # zero-filled: every step counter starts at 0
            os.close(fd)
        dist.barrier()
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        dist.barrier()
        if rank == 0:
            os.unlink(path)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._step = 0

    def usable_for(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (same rank order on every rank)."""
        self._advance(self._reduce(self._base, x.data_ptr(), x.numel(), self.rank, self.world_size, self.chunk,
                                   self._step, TIMEOUT_S))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[world_size, *x.shape]``: every rank's ``x`` (same shape on every rank), in rank order."""
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype)
        self._advance(self._gather(self._base, x.data_ptr(), out.data_ptr(), x.numel(), self.rank, self.world_size,
                                   self.chunk, self._step, TIMEOUT_S))
        return out

    def _advance(self, step: int) -> None:
        if step < 0:
            raise RuntimeError(f"shared-memory collective: no answer from a peer rank within {TIMEOUT_S:.0f} s")
        self._step = step


def maybe_create(rank: int, world_size: int) -> ShmAllReduce | None:
    """A ``ShmAllReduce`` when every rank is on this host and the kernel builds, else ``None``.
    A collective: every rank must call it."""
    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, _host_id())
    usable = enabled() and len(set(hosts)) == 1 and kernels.load("shm_allreduce", _SIGNATURES) is not None
    votes: list[bool] = [False] * world_size
    dist.all_gather_object(votes, usable)  # all or none: a rank that cannot build makes everyone use gloo
    if not all(votes):
        return None
    name = [f"pagellm-tp-{os.getpid()}-{secrets.token_hex(4)}"]  # rank 0's name is everyone's
    dist.broadcast_object_list(name, src=0)
    return ShmAllReduce(rank, world_size, name[0])
