"""The token-level stop rule (vLLM's ``check_stop``): EOS, stop token ids, ``max_tokens`` and
``max_model_len``, applied to a sequence's last appended token. Stop *strings* need the text and
are the output processor's (``engine/output_processor.py``)."""

from __future__ import annotations

from pagellm.sampling_params import SamplingParams
from pagellm.sequence import Sequence, SequenceStatus


def check_stop(seq: Sequence, params: SamplingParams, max_model_len: int) -> None:
    """Set ``seq``'s finished status (and ``stop_reason`` for a stop token id) when its last token
    ends it. EOS and stop ids count only from ``min_tokens`` on; length limits always."""
    token = seq.output_token_ids[-1]
    n_out = seq.num_output_tokens
    if n_out >= params.min_tokens:
        if not params.ignore_eos and token == params.eos_token_id:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if token in (params.stop_token_ids or ()):
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = token
            return
    if (params.max_tokens is not None and n_out >= params.max_tokens) or seq.num_tokens >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
