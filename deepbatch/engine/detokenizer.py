"""Incremental detokenization and stop strings.

Text is produced with tokenizers' ``DecodeStream``, which holds back bytes until they form valid
UTF-8, so a streamed chunk never splits a character. Stop strings are searched only in the part
of the text that the newest chunk could have completed.
"""

from __future__ import annotations

from deepbatch.core.request import Request


class Detokenizer:
    def __init__(self, tokenizer, fault_request_id: str | None = None):
        """``fault_request_id`` (testing only) makes ``update`` raise for that request or parent."""
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "_tokenizer", None) if tokenizer is not None else None
        self.fault_request_id = fault_request_id

    def update(self, request: Request, new_token_ids: list[int]) -> str | None:
        """Append the text of ``new_token_ids`` to ``request.output_text``; returns the stop
        string that matched (and truncates the text at it), or None."""
        if self.fault_request_id is not None and self.fault_request_id in (request.request_id, request.parent_id):
            raise RuntimeError(f"injected detokenization fault for request {self.fault_request_id}")
        if self._backend is None:
            return None
        from tokenizers.decoders import DecodeStream

        params = request.sampling_params
        if request.detok_state is None:
            request.detok_state = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        before = len(request.output_text)
        chunks = []
        for tok in new_token_ids:
            piece = request.detok_state.step(self._backend, tok)
            if piece:
                chunks.append(piece)
        if not chunks:
            return None
        request.output_text += "".join(chunks)
        if not params.stop:
            return None
        text = request.output_text
        longest = max(len(s) for s in params.stop)
        window_start = max(0, before - longest + 1)
        best = None
        for stop in params.stop:
            pos = text.find(stop, window_start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        request.output_text = text[: pos + len(stop)] if params.include_stop_str_in_output else text[:pos]
        return stop
