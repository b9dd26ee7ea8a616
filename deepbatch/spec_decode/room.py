"""Which running requests may draft in a step, and how many tokens: the rules every proposer
shares."""

from __future__ import annotations


def speculation_off(config, running: list) -> bool:
    """``disable_by_batch_size``: no drafts in a step with more running requests than that."""
    return config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size


def draft_room(r, num_speculative_tokens: int, max_model_len: int) -> int:
    """How many drafts request ``r`` may take this step (0: none): only a decoding request with
    its newest token committed, and the step adds the accepted drafts and one token more, so
    neither ``max_tokens`` nor the context length may be passed."""
    if r.num_pending_tokens or r.num_tokens - r.num_computed_tokens != 1:
        return 0
    return max(0, min(num_speculative_tokens, r.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens - 1))
