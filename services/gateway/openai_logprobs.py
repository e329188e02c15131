"""Log-probabilities in the OpenAI API's shapes, as vLLM writes them.

- completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per
  token; a position's `top_logprobs` maps token text to logprob for the chosen token and the k
  most likely (up to k + 1 entries, as OpenAI's API says); with `echo` the prompt's tokens come
  first, the very first with `null` (nothing predicts it). `text_offset` is each token's start
  in the concatenation of the token strings, counted from the reply's first token and carried
  on from chunk to chunk, so a streamed reply has the offsets of the whole one;
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}`, `top_logprobs` the k most likely tokens, most likely first;
- vLLM's `prompt_logprobs`: `[null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]`, the
  prompt token's entry first, then the k most likely.

A token's text is the token decoded alone (special tokens included), or `token_id:<id>` with
`return_tokens_as_token_ids`. -inf (a token the model rules out) is written -9999.0, as
OpenAI and vLLM do: JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.logprobs import TokenLogprobs

FLOOR = -9999.0
# Token ids -> the text of each alone (Tokenizer.token_texts).
TokenTexts = Callable[[Sequence[int]], list[str]]


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


@dataclass
class LogprobsWriter:
    """Writes one reply's logprobs: `k` alternatives per position, token texts from
    `token_texts` (or `token_id:<id>` when `as_ids`). Completions' text offsets continue from
    one call to the next (the chunks of one stream)."""

    k: int
    token_texts: TokenTexts
    as_ids: bool = False
    offset: int = 0

    def _texts(self, positions: Sequence[tuple[int, TokenLogprobs | None]]) -> dict[int, str]:
        ids = {t for t, _ in positions}
        for _, lp in positions:
            if lp is not None:
                ids.update(lp.top_ids[: self.k])
        order = sorted(ids)
        if self.as_ids:
            return {t: f"token_id:{t}" for t in order}
        return dict(zip(order, self.token_texts(order), strict=True))

    def completion(self, positions: Sequence[tuple[int, TokenLogprobs | None]]) -> dict:
        """Completions' logprobs object of (token id, its logprobs or None) positions."""
        text = self._texts(positions)
        tokens, values, tops, offsets = [], [], [], []
        for token, lp in positions:
            tokens.append(text[token])
            offsets.append(self.offset)
            self.offset += len(text[token])
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_value(lp.logprob))
            top = {text[token]: _value(lp.logprob)}
            for t, v in zip(lp.top_ids[: self.k], lp.top_logprobs, strict=False):
                top.setdefault(text[t], _value(v))
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat(self, logprobs: Sequence[TokenLogprobs]) -> dict:
        """Chat's logprobs object of the generated tokens' logprobs."""
        text = self._texts([(lp.token_id, lp) for lp in logprobs])

        def entry(token: int, logprob: float) -> dict:
            word = text[token]
            return {
                "token": word,
                "logprob": _value(logprob),
                "bytes": list(word.encode("utf-8", errors="replace")),
            }

        return {
            "content": [
                {
                    **entry(lp.token_id, lp.logprob),
                    "top_logprobs": [
                        entry(t, v)
                        for t, v in zip(lp.top_ids[: self.k], lp.top_logprobs, strict=False)
                    ],
                }
                for lp in logprobs
            ]
        }


def prompt_logprobs(logprobs: Sequence[TokenLogprobs], token_texts: TokenTexts) -> list:
    """vLLM's prompt_logprobs of the prompt's positions 1.. (position 0 is `null`)."""
    ids = sorted({t for lp in logprobs for t in (lp.token_id, *lp.top_ids)})
    text = dict(zip(ids, token_texts(ids), strict=True))
    out: list[dict | None] = [None]
    for lp in logprobs:
        position = {
            str(lp.token_id): {
                "logprob": _value(lp.logprob),
                "rank": lp.rank,
                "decoded_token": text[lp.token_id],
            }
        }
        for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), start=1):
            position.setdefault(
                str(t), {"logprob": _value(v), "rank": rank, "decoded_token": text[t]}
            )
        out.append(position)
    return out
