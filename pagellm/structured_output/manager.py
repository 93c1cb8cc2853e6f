"""``StructuredOutputManager``: compiles constraints off the engine loop and keeps the matchers.

The engine hands it every constrained request on arrival; the request waits here (vLLM's
``WAITING_FOR_FSM``) while a worker thread compiles, and the scheduler never sees it until its
grammar is ready, so nobody else waits. Compiled grammars are cached by their spec. Each step
``fill_bitmask`` writes one row per constrained sequence that samples; after the step ``accept``
advances each sequence's matcher by its new tokens. Matchers follow the tokens, not the blocks:
a sequence preempted by recompute or swap keeps its matcher, and a fork (``n > 1``, beam search)
gets a fresh one that replays the parent's output tokens.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.reasoning import ThinkTokens
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.sequence import Sequence, SequenceGroup
from pagellm.structured_output.backend import (
    BACKENDS,
    CompiledGrammar,
    GrammarCompileError,
    Matcher,
    StructuredOutputBackend,
    allocate_bitmask,
)

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 30.0
_CACHE_SIZE = 256


def create_backend(name: str, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> StructuredOutputBackend:
    """The grammar library by name (imported on first use: the base classes in ``backend`` know
    none of them). ``auto``: llguidance (3 MB, no dependencies; docs/structured_output.md has the measurements),
    xgrammar when asked for (``pip install pagellm[xgrammar]``)."""
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_config backend must be one of {BACKENDS}, got {name!r}")
    if name in ("auto", "guidance"):
        from pagellm.structured_output.guidance import GuidanceBackend

        return GuidanceBackend(hf_tokenizer, vocab_size, eos_token_id)
    try:
        from pagellm.structured_output.xgrammar import XgrammarBackend
    except ImportError as e:
        raise ValueError("the xgrammar backend needs the xgrammar package: pip install 'pagellm[xgrammar]'") from e
    return XgrammarBackend(hf_tokenizer, vocab_size, eos_token_id)


@dataclass(slots=True)
class StructuredOutputStats:
    """Counters since start (``pagellm.metrics`` exports them)."""

    grammars_compiled: int = 0
    compile_seconds: float = 0.0
    compile_failures: int = 0
    mask_seconds: float = 0.0
    masks_filled: int = 0


class StructuredOutputManager:
    """One per engine. ``backend``: ``auto`` | ``guidance`` | ``xgrammar``."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None, backend: str = "auto",
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, think: ThinkTokens | None = None) -> None:
        self._backend_args = (backend, hf_tokenizer, vocab_size, eos_token_id)
        self._backend: StructuredOutputBackend | None = None
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.compile_timeout_s = compile_timeout_s
        # One thread: compiles are rare (cached by spec) and must not take the step loop's second core.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-grammar")
        self._cache: OrderedDict[tuple[str, str, bool], Future[CompiledGrammar]] = OrderedDict()
        self._pending: dict[str, tuple[SequenceGroup, Future[CompiledGrammar], float]] = {}
        self._grammars: dict[str, CompiledGrammar] = {}
        self._matchers: dict[int, tuple[Matcher, list[int]]] = {}  # seq_id -> (matcher, tokens it took)
        self.stats = StructuredOutputStats()
        # A reasoning parser's tags: the grammar constrains only the answer after the think block.
        self.think = think

    # ------------------------------------------------------------------ compiling
    @property
    def backend(self) -> StructuredOutputBackend:
        if self._backend is None:
            self._backend = create_backend(*self._backend_args)
        return self._backend

    def _compile_timed(self, params: StructuredOutputsParams) -> CompiledGrammar:
        t0 = time.perf_counter()
        try:
            return self.backend.compile(params)
        finally:
            self.stats.compile_seconds += time.perf_counter() - t0

    def _compile(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        key = params.key()
        fut = self._cache.get(key)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._cache.move_to_end(key)
            return fut
        fut = self._pool.submit(self._compile_timed, params)
        self._cache[key] = fut
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return fut

    def _timed_out(self) -> str:
        return f"structured_outputs: the constraint did not compile within {self.compile_timeout_s:g} s"

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile now (or find it cached) and raise ``GrammarCompileError`` (a ``ValueError``) if it
        does not compile: for front ends that want a bad constraint refused before it is queued."""
        try:
            self._compile(params).result(timeout=self.compile_timeout_s)
        except TimeoutError as e:
            raise GrammarCompileError(self._timed_out()) from e

    def add_request(self, group: SequenceGroup) -> None:
        params = group.sampling_params.structured_outputs
        assert params is not None
        self._pending[group.request_id] = (group, self._compile(params), time.monotonic())

    def take_ready(self) -> tuple[list[SequenceGroup], list[tuple[SequenceGroup, str]]]:
        """Requests whose grammar is now compiled (for the scheduler), and those that failed with why."""
        ready: list[SequenceGroup] = []
        failed: list[tuple[SequenceGroup, str]] = []
        now = time.monotonic()
        for rid, (group, fut, since) in list(self._pending.items()):
            if fut.done():
                del self._pending[rid]
                error = fut.exception()
                if error is None:
                    self._grammars[rid] = fut.result()
                    self.stats.grammars_compiled += 1
                    ready.append(group)
                else:
                    self.stats.compile_failures += 1
                    failed.append((group, str(error) if isinstance(error, GrammarCompileError)
                                   else f"structured_outputs: the constraint does not compile: {error}"))
            elif now - since > self.compile_timeout_s:
                del self._pending[rid]
                self.stats.compile_failures += 1
                failed.append((group, self._timed_out()))
        return ready, failed

    @property
    def num_waiting_for_fsm(self) -> int:
        return len(self._pending)

    @property
    def num_constrained(self) -> int:
        return len(self._grammars)

    def pending_group(self, request_id: str) -> SequenceGroup | None:
        entry = self._pending.get(request_id)
        return entry[0] if entry else None

    def wait_any(self, timeout: float) -> None:
        """Block until some pending compile finishes or ``timeout`` seconds pass."""
        futures = [fut for _, fut, _ in self._pending.values()]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def pending_groups(self) -> list[SequenceGroup]:
        return [g for g, _, _ in self._pending.values()]

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Drop a request still waiting for its grammar; returns it (``None`` if it was not waiting)."""
        entry = self._pending.pop(request_id, None)
        return entry[0] if entry else None

    def forget(self, group: SequenceGroup) -> None:
        """A finished request: drop its grammar and matchers."""
        self._pending.pop(group.request_id, None)
        self._grammars.pop(group.request_id, None)
        for seq in group.seqs:
            self._matchers.pop(seq.seq_id, None)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._grammars

    # ------------------------------------------------------------------ each step
    def _matcher(self, request_id: str, seq: Sequence) -> tuple[Matcher, list[int]]:
        """The sequence's matcher, advanced to its current output; a new sequence (a fork) replays
        its tokens into a fresh one."""
        entry = self._matchers.get(seq.seq_id)
        if entry is None:
            entry = (self._grammars[request_id].new_matcher(), [])
            self._matchers[seq.seq_id] = entry
        return entry

    def advance(self, request_id: str, seq: Sequence) -> str | None:
        """Feed ``seq``'s tokens generated since the last call to its matcher. Returns ``"rejected"``
        if the grammar refused one (should not happen: the mask allowed it), ``"terminated"`` when
        the grammar is complete, else ``None``."""
        out = self._answer(seq)
        if out is None:  # still thinking: the grammar waits
            return None
        matcher, taken = self._matcher(request_id, seq)
        n = len(taken)
        if n > len(out) or (n and taken[-1] != out[n - 1]):  # (defensive) a different history: replay
            matcher, taken, n = self._grammars[request_id].new_matcher(), [], 0
            self._matchers[seq.seq_id] = (matcher, taken)
        if n == len(out):  # nothing new (most calls from fill_bitmask): no slicing, no copies
            return "terminated" if matcher.is_terminated() else None
        for tok in out[n:]:
            if matcher.is_terminated():
                return "terminated"
            if not matcher.accept_token(tok):
                return "rejected"
            taken.append(tok)
        return "terminated" if matcher.is_terminated() else None

    def _answer(self, seq: Sequence) -> list[int] | None:
        """The output tokens the grammar constrains: all of them, or with a reasoning parser those
        after the think block (``None`` until it closed)."""
        if self.think is None:
            return seq.output_token_ids
        start = self.think.answer_start(seq.prompt_token_ids, seq.output_token_ids)
        return None if start is None else seq.output_token_ids[start:]

    def fill_bitmask(self, rows: list[tuple[str, Sequence]]) -> np.ndarray:
        """One bitmask row per ``(request_id, sequence)``, each advanced to its current tokens first."""
        t0 = time.perf_counter()
        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        for i, (rid, seq) in enumerate(rows):
            if self.advance(rid, seq) == "terminated":  # complete (a beam that goes on): only the end may follow
                bitmask[i] = 0
                if self.eos_token_id is not None:
                    word, bit = divmod(self.eos_token_id, 32)
                    bitmask[i, word] = np.uint32(1 << bit).view(np.int32)
            else:
                self._matcher(rid, seq)[0].fill_bitmask(bitmask, i)
        self.stats.mask_seconds += time.perf_counter() - t0
        self.stats.masks_filled += len(rows)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def decorate_step(self, so: SchedulerOutput, requests: Mapping[str, SequenceGroup]) -> None:
        """One bitmask row per constrained sequence that samples this step (forks at a first
        sample share their parent's row: they start from the same grammar state)."""
        if not self.num_constrained:
            return
        rows: list[tuple[str, Sequence]] = []
        for s in so.scheduled:
            if s.do_sample and self.is_constrained(s.request_id):
                seq = next(q for q in requests[s.request_id].seqs if q.seq_id == s.seq_id)
                if self.think is not None and self._answer(seq) is None:
                    continue  # thinking: unconstrained
                so.structured_output_rows[s.seq_id] = len(rows)
                rows.append((s.request_id, seq))
        if rows:
            so.grammar_bitmask = self.fill_bitmask(rows)
