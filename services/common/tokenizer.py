"""Tokenizer and incremental detokenizer, shared by the engine and the gateway (no torch here).

A model folder's `tokenizer.json` is loaded through the `tokenizers` package. A folder without
one is refused (ModelLoadError naming what it holds instead): serving it with some other
tokenizer would give text that is not the model's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from services.common.errors import ModelLoadError

# How many prompt tokens the detokenizer keeps as left context, so that the first generated
# token decodes with the spacing it has after the prompt (sentencepiece-style prefixes).
_DETOKENIZE_CONTEXT = 5

# The special tokens of tokenizer_config.json that chat templates read (transformers passes its
# special_tokens_map, these names, to every template).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Files a folder may hold instead of tokenizer.json, named in the refusal: tokenizers a slow
# (Python) tokenizer of transformers reads, which `tokenizers` cannot load as they are.
_SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")


class Tokenizer:
    """Text <-> token ids for one model folder, plus the ids that end generation and what a
    chat template needs (the folder's template source and its special tokens)."""

    def __init__(
        self,
        *,
        backend: object,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._backend = backend  # a tokenizers.Tokenizer
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model folder: `tokenizer.json`, the end-of-sequence
        ids of generation_config.json (else config.json), and the chat template:
        `chat_template.jinja` (where transformers >= 4.43 writes it) before
        tokenizer_config.json's `chat_template`."""
        path = Path(path)
        config = _read_json(path / "config.json") or {}
        generation = _read_json(path / "generation_config.json") or {}
        tok_config = _read_json(path / "tokenizer_config.json") or {}
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        bos = generation.get("bos_token_id", config.get("bos_token_id"))
        file = path / "tokenizer.json"
        if not file.exists():
            raise ModelLoadError(_no_tokenizer_message(path))
        from tokenizers import Tokenizer as HfTokenizer

        try:
            backend = HfTokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers package raises a bare Exception
            raise ModelLoadError(f"{file} cannot be read: {e}") from e
        return cls(
            backend=backend,
            eos_token_ids=eos_ids,
            bos_token_id=bos,
            chat_template=_chat_template(path, tok_config),
            special_tokens=_special_tokens(tok_config),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer's template adds (e.g. BOS)
        unless `add_special_tokens` is off (a chat template that writes its own)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_within(
        self, text: str, limit: int, add_special_tokens: bool = True
    ) -> tuple[int, list[int] | None]:
        """(token count, ids), ids None when the count is over `limit`: a text too long for
        the context is counted without building its list of ids. Encoded as a batch of one:
        the tokenizers package releases the GIL for a batch (not for `encode`; measured: a
        4 Mi-character prompt held it for 12 s), so this may run on a worker thread while the
        event loop serves others."""
        encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        n = len(encoding)
        return n, encoding.ids if n <= limit else None

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (e.g. a special token), or None."""
        return self._backend.token_to_id(token)

    def token(self, token_id: int | None) -> str | None:
        """The text of a vocabulary token by id (e.g. the BOS token's), or None."""
        if token_id is None:
            return None
        return self._backend.id_to_token(token_id)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (without special tokens unless told); incomplete UTF-8 sequences
        become U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded alone, special tokens included (logprobs' token strings, as vLLM
        writes them); a partial UTF-8 character becomes U+FFFD."""
        return self._backend.decode_batch([[t] for t in ids], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Decodes a short window of ids twice (without and with the new ids) and emits the difference,
    holding it back while it ends in U+FFFD, the mark of a character whose bytes are still coming.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special: bool = True
    ) -> None:
        self._skip = skip_special
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text = ""  # everything emitted so far

    def add(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that is now complete (maybe empty)."""
        self._ids.extend(new_ids)
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(self._prefix_text) or full.endswith("\ufffd"):
            return ""
        return self._emit(full)

    def flush(self) -> str:
        """At the end of the stream: whatever is left, even an incomplete character."""
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(self._prefix_text):
            return ""
        return self._emit(full)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, full: str) -> str:
        delta = full[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset :])
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


def _chat_template(path: Path, tok_config: dict) -> str | None:
    """The folder's chat template source: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates of which "default" is used)."""
    file = path / "chat_template.jinja"
    if file.exists():
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{file} cannot be read: {e}") from e
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _special_tokens(tok_config: dict) -> dict[str, str]:
    """tokenizer_config.json's special tokens by name; each is a string or an AddedToken
    object (`{"content": ...}`)."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tok_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _no_tokenizer_message(path: Path) -> str:
    found = [f for f in _SLOW_TOKENIZER_FILES if (path / f).exists()]
    held = f" (it has {', '.join(found)}: a slow tokenizer's files)" if found else ""
    return (
        f"model folder {path} has no tokenizer.json{held}; the mesh reads tokenizers through "
        "the `tokenizers` package. Write one with transformers: "
        "AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
    )
