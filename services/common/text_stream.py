"""The text of a token stream: incremental detokenization plus stop strings.

Used by the engine (to stop generation at a stop string) and by the gateway (to stream text).
While stop strings are set, the last (longest stop string - 1) characters are held back, so that
a stop string split across tokens is never partly streamed; the stop string itself is cut
(kept, with include_stop).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """Text deltas of generated ids, cut at the first stop string."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        *,
        include_stop: bool = False,
        skip_special: bool = True,
    ) -> None:
        """min_tokens: stop strings are looked for only once more than this many ids were
        added (as vLLM does): text of the first min_tokens ids never stops the stream.
        include_stop: the stop string that ends the text is kept; skip_special: special
        tokens are left out of the text."""
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special)
        self._include_stop = include_stop
        self._stop = tuple(stop)
        self._unchecked_ids = min_tokens
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._emitted = 0  # characters handed out
        self._searched = 0  # characters already searched for stop strings
        self._end: int | None = None  # where a stop string cut the text
        self.stopped = False  # a stop string was found

    @property
    def text(self) -> str:
        """All text so far, without a stop string that ended it."""
        return self._detok.text[: self._end]

    def add(self, ids: Sequence[int]) -> str:
        """Append generated ids; return the text that can be streamed now."""
        self._detok.add(ids)
        if self._unchecked_ids > 0:
            self._unchecked_ids -= len(ids)
            if self._unchecked_ids >= 0:
                self._searched = len(self._detok.text) + self._holdback
        return self._take(final=False)

    def finish(self) -> str:
        """At the end of generation: the rest of the text, incomplete characters included."""
        if not self.stopped:
            self._detok.flush()
        return self._take(final=True)

    def _take(self, *, final: bool) -> str:
        text = self._detok.text
        if self._stop and not self.stopped:
            start = max(0, self._searched - self._holdback)
            self._searched = len(text)
            hits = [(i, len(s)) for s in self._stop if (i := text.find(s, start)) >= 0]
            if hits:
                at, length = min(hits)
                self._end = at + length if self._include_stop else at
                self.stopped = True
        end = len(text) if self._end is None else self._end
        if not (final or self.stopped):
            end -= self._holdback
        if end <= self._emitted:
            return ""
        delta = text[self._emitted : end]
        self._emitted = end
        return delta
