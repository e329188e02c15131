"""Tokenizer and incremental detokenizer, shared by the engine and the gateway (no torch here).

A model folder's `tokenizer.json` is loaded through the `tokenizers` package; a folder without one
gets a byte-level fallback (token id = byte value), which every vocabulary of >= 256 ids can use.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from services.common.errors import ModelLoadError

# How many prompt tokens the detokenizer keeps as left context, so that the first generated
# token decodes with the spacing it has after the prompt (sentencepiece-style prefixes).
_DETOKENIZE_CONTEXT = 5


class Tokenizer:
    """Text <-> token ids for one model folder, plus the ids that end generation."""

    def __init__(
        self,
        *,
        backend: object | None,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend  # tokenizers.Tokenizer, or None for bytes
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        config = _read_json(path / "config.json") or {}
        generation = _read_json(path / "generation_config.json") or {}
        tok_config = _read_json(path / "tokenizer_config.json") or {}
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        bos = generation.get("bos_token_id", config.get("bos_token_id"))
        template = tok_config.get("chat_template")
        if (path / "tokenizer.json").exists():
            from tokenizers import Tokenizer as HfTokenizer

            try:
                backend = HfTokenizer.from_file(str(path / "tokenizer.json"))
            except Exception as e:  # the tokenizers package raises a bare Exception
                raise ModelLoadError(f"{path / 'tokenizer.json'} cannot be read: {e}") from e
            vocab = backend.get_vocab_size(with_added_tokens=True)
            return cls(
                backend=backend,
                vocab_size=vocab,
                eos_token_ids=eos_ids,
                bos_token_id=bos,
                chat_template=template,
            )
        return cls(backend=None, vocab_size=256, eos_token_ids=eos_ids, bos_token_id=bos)

    @property
    def is_byte_level_fallback(self) -> bool:
        return self._backend is None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer's template adds (e.g. BOS)
        unless `add_special_tokens` is off (a chat template that writes its own)."""
        if self._backend is None:
            ids = list(text.encode("utf-8"))
            bos = self.bos_token_id
            return [bos, *ids] if bos is not None and add_special_tokens else ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_within(
        self, text: str, limit: int, add_special_tokens: bool = True
    ) -> tuple[int, list[int] | None]:
        """(token count, ids), ids None when the count is over `limit`: a text too long for
        the context is counted without building its list of ids. Encoded as a batch of one:
        the tokenizers package releases the GIL for a batch (not for `encode`; measured: a
        4 Mi-character prompt held it for 12 s), so this may run on a worker thread while the
        event loop serves others."""
        if self._backend is None:
            ids = self.encode(text, add_special_tokens)
            return len(ids), ids if len(ids) <= limit else None
        encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        n = len(encoding)
        return n, encoding.ids if n <= limit else None

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (e.g. a special token), or None."""
        if self._backend is None:
            return None
        return self._backend.token_to_id(token)

    def token(self, token_id: int | None) -> str | None:
        """The text of a vocabulary token by id (e.g. the BOS token's), or None."""
        if self._backend is None or token_id is None:
            return None
        return self._backend.id_to_token(token_id)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` without special tokens; incomplete UTF-8 sequences become U+FFFD."""
        if self._backend is None:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self._backend.decode(list(ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Decodes a short window of ids twice (without and with the new ids) and emits the difference,
    holding it back while it ends in U+FFFD, the mark of a character whose bytes are still coming.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = tokenizer.decode(self._ids)
        self.text = ""  # everything emitted so far

    def add(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that is now complete (maybe empty)."""
        self._ids.extend(new_ids)
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(self._prefix_text) or full.endswith("\ufffd"):
            return ""
        return self._emit(full)

    def flush(self) -> str:
        """At the end of the stream: whatever is left, even an incomplete character."""
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(self._prefix_text):
            return ""
        return self._emit(full)

    def _emit(self, full: str) -> str:
        delta = full[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._tok.decode(self._ids[self._prefix_offset :])
        self.text += delta
        return delta


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        with path.open() as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
