"""Incremental detokenization with stop strings cut exactly."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from lantau.request import SamplingParams


class IncrementalDetokenizer:
    """Text of one output sequence, grown one token at a time.

    Uses the Rust tokenizer's DecodeStream, which holds back bytes of an unfinished UTF-8
    character. A stop string ends the text at its start (or its end, when it is to be kept).
    """

    def __init__(
        self,
        tokenizer,
        params: SamplingParams,
        prompt_token_ids: list[int],
        fold_ids_at: int | None = None,
    ) -> None:
        """`fold_ids_at`: ids from there on are spelled as id mod it (a random-weight model
        whose vocabulary outgrows the tokenizer it borrows; see model.source)."""
        self.fold_ids_at = fold_ids_at
        self._backend = tokenizer._tokenizer  # the tokenizers.Tokenizer under the HF wrapper
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.params = params
        self.text = ""
        self.stop_reason: str | None = None
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._num_tokens = 0  # no stop string before params.min_tokens of them

    def add_token(self, token_id: int) -> bool:
        """Append one token; True when a stop string ended the sequence."""
        if self.fold_ids_at is not None and token_id >= self.fold_ids_at:
            token_id %= self.fold_ids_at
        delta = self._stream.step(self._backend, token_id)
        self._num_tokens += 1
        if not delta:
            return False
        if self._num_tokens <= self.params.min_tokens:
            self.text += delta
            return False
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        return self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, search_from)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        keep = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.text = self.text[:keep]
        self.stop_reason = stop
        return True
