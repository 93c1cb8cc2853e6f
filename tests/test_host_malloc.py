"""glibc's allocator tuning (``worker/host_malloc.py``): freed activations are reused, not faulted in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt")

# Activations whose size changes from step to step (a step's token count does), each written and
# freed, after the worker's tuning (or not), in two passes over the same sizes (later steps repeat
# earlier steps' sizes); prints the minor page faults each pass cost.
SCRIPT = """
import resource, sys, torch
from pagellm.worker.host_malloc import tune_malloc
print(tune_malloc())
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for mib in range(int(sys.argv[1]), int(sys.argv[2])):
        torch.ones(mib << 18)  # written: every page touched
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tuning: str, mib: range) -> tuple[str, int, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(mib.start), str(mib.stop)],
                         env={"PAGELLM_MALLOC_TUNING": tuning, "PATH": ""},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], int(out[1]), int(out[2])


# 8 to 28 MiB: under glibc's mmap ceiling (SmolLM2's 2048-token gate/up output is 24 MiB); 40 to 60
# MiB: above it (a 1024-wide model with a 3072-wide MLP writes 48 MiB).
@pytest.mark.parametrize("mib", [range(8, 29), range(40, 61)])
def test_tuned_allocator_reuses_freed_activations_instead_of_faulting_them_in(mib):
    tuned, tuned_first, tuned_again = _faults("1", mib)
    untuned, untuned_first, _ = _faults("0", mib)
    assert (tuned, untuned) == ("True", "False")
    pages = sum(mib) * 256
    # Untuned, each tensor larger than the last is a fresh mmap (glibc raises its threshold only
    # after freeing one), faulted in page by page. Tuned, the heap grows towards the largest (by how
    # much depends on the process's layout: 10-23 % of the pages seen here, CI's highest run) and
    # then serves every size again from memory already faulted in.
    assert untuned_first > pages // 2
    assert tuned_first < untuned_first // 2
    assert tuned_again < pages // 50


def test_the_worker_tunes_the_allocator_only_once_the_model_is_loaded(tiny_llama, monkeypatch):
    """Tuned before loading, the heap kept loading's transients as (trimmed) holes, and each step's
    activations wandered into fresh ones: a 1.7B Q4_K_M's RSS grew 260, 39, 65, 33 and 27 MiB over
    five identical 2,048-token steps (stable after the first once tuned after loading)."""
    from pagellm import LLM
    from pagellm.worker import worker
    from pagellm.worker.model_loader import ModelLoader

    events: list[str] = []
    load_target = ModelLoader.load_target

    def loaded(self):
        model = load_target(self)
        events.append("loaded")
        return model

    monkeypatch.setattr(ModelLoader, "load_target", loaded)
    monkeypatch.setattr(worker, "tune_malloc", lambda: events.append("tuned") or True)
    LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=256)
    assert events == ["loaded", "tuned"]
