"""The grammar engine in the model runtime: compiled grammars per tokenizer, one matcher per
constrained sequence, and the step's bitmask over the batch's logits.

llguidance (docs/engine.md says why) does the work: `GrammarCompiler` compiles a request's
`StructuredOutput` (services/common/structured_output.py: the same grammar text the gateway
checked) against the model's tokenizer, once per spec: later requests with the same spec copy
the compiled matcher. A `Matcher` belongs to one sequence: it reads the sequence's tokens as
they are appended (Sequence.append), so a matcher rebuilt from the spec and the tokens so far
(decode after prefill's first token, a migrated request's replayed answer) is in the same
state. `GrammarMask` fills the bitmask of every constrained row of a step on the CPU (rows in
parallel, without the GIL) and sets the other tokens' logits to -inf before the sampler runs;
rows without a constraint are not touched.

No torch at import: the emulated engine (no logits) uses `Matcher.allowed` instead.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy as llg_np
import numpy as np

from services.common.errors import InvalidRequest
from services.common.structured_output import PARAM, StructuredOutput

if TYPE_CHECKING:
    import torch

log = logging.getLogger("distserve.engine.structured")

COMPILED_CACHE = 256  # compiled specs kept per engine (least recently used dropped)


class Matcher:
    """The grammar state of one sequence: which tokens may come next, and whether the answer
    is complete (`done`: nothing may follow but EOS, or the grammar met a token it refused)."""

    def __init__(self, ll: llguidance.LLMatcher, vocab_size: int) -> None:
        self.ll = ll
        self.vocab_size = vocab_size

    def consume(self, token: int) -> None:
        """Advance over a sampled token (always one the mask allowed)."""
        if not self.ll.consume_token(token) and not self.ll.is_stopped():
            log.warning("grammar refused token %d: %s", token, self.ll.get_error())

    @property
    def done(self) -> bool:
        return self.ll.is_stopped()

    def allowed(self) -> np.ndarray:
        """Ids of the tokens allowed next, ascending (the emulated engine draws from them)."""
        bits = np.frombuffer(self.ll.compute_bitmask(), dtype=np.uint8)
        return np.flatnonzero(np.unpackbits(bits, bitorder="little")[: self.vocab_size])


class GrammarCompiler:
    """Compiles specs against one model's tokenizer (built on the first constrained request,
    as vLLM builds its backend: an engine that never sees one never pays for it)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids) or None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json.read_text(), n_vocab=self.vocab_size, eos_token=self._eos
            )
        return self._tokenizer

    def matcher(self, spec: StructuredOutput, prompt_ids: Sequence[int]) -> Matcher:
        """A new sequence's matcher, advanced over the prompt's last `spec.replay_tokens`.
        InvalidRequest (naming `structured_output`) when no answer can match (a regex or
        grammar whose language is empty for this tokenizer) or the replayed tokens do not."""
        grammar = spec.grammar()
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            compiled.compute_bitmask()  # the first mask: an empty language shows only here
            if compiled.is_error():
                raise InvalidRequest(
                    f"the {spec.kind.value} constraint matches no answer: "
                    f"{_first_line(compiled.get_error())}",
                    param=PARAM,
                )
            self._compiled[grammar] = compiled
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        ll = compiled.deep_copy()
        replay = spec.replay_tokens
        if replay:
            if replay >= len(prompt_ids):
                raise InvalidRequest(
                    f"replay_tokens ({replay}) must be less than the prompt's {len(prompt_ids)} "
                    "tokens",
                    param=PARAM,
                )
            if not ll.consume_tokens(list(prompt_ids[-replay:])):
                raise InvalidRequest(
                    f"the prompt's last {replay} tokens (replay_tokens) do not match the "
                    f"{spec.kind.value} constraint: {_first_line(ll.get_error())}",
                    param=PARAM,
                )
        return Matcher(ll, self.vocab_size)


class GrammarMask:
    """The bitmask buffer of a runner's largest batch, and its application to logits."""

    def __init__(self, max_num_seqs: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bitmask = llg_np.allocate_token_bitmask(max_num_seqs, vocab_size)  # (B, W) int32
        self.executor = llguidance.LLExecutor()
        self._shifts: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> None:
        """Set to -inf, in place, the logits (B, V) of every token the matcher of row rows[i]
        does not allow next. The masks are computed on the CPU while a GPU still runs the
        step's forward (nothing here waits for it); a GPU gets them as (n, V/32) words and
        unpacks them itself, a CPU unpacks them with numpy (faster there than torch's shifts).
        """
        import torch

        n = len(rows)
        if n > self.bitmask.shape[0]:
            self.bitmask = llg_np.allocate_token_bitmask(n, self.vocab_size)
        words = self.bitmask[:n]  # (n, W) int32, C-contiguous: bit j of word w is token 32w+j
        llg_np.fill_next_token_bitmask_par(
            self.executor, [(m.ll, i) for i, m in enumerate(matchers)], words
        )
        vocab = logits.shape[-1]
        device = logits.device
        if device.type == "cpu":
            refused = np.unpackbits(~words.view(np.uint8), axis=1, bitorder="little")
            banned = torch.from_numpy(refused[:, :vocab].view(np.bool_))  # (n, V)
        else:
            if self._shifts is None or self._shifts.device != device:
                self._shifts = torch.arange(32, dtype=torch.int32, device=device)
            packed = torch.from_numpy(~words).to(device, non_blocking=True)  # (n, W)
            bits = (packed[:, :, None] >> self._shifts) & 1  # (n, W, 32)
            banned = bits.view(n, -1)[:, :vocab].bool()  # (n, V)
        if n == logits.shape[0]:  # every row constrained (rows are distinct and ascending)
            logits.masked_fill_(banned, float("-inf"))
            return
        index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        logits[index] = logits[index].masked_fill(banned, float("-inf"))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no token can follow"
