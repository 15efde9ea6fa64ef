"""Grammar masks: structured outputs (JSON schemas, any JSON object, regexes, choices) as a
logits processor that stays lossless under speculation.

The grammar library is llguidance (an Earley parser over a lexer, computing each token mask
lazily in ~0.1 ms for JSON schemas, with rollback; vLLM and SGLang ship it as a structured
output backend). A `GrammarConstraint` is a `LogitsProcessor` (logits_process.py): its mask
depends only on the completion's ids, so verification rows of a draft tree get exactly the
mask plain decoding would apply at that position. It keeps one matcher at the last position it
was asked about and moves it along each request by rolling back to the common prefix and
consuming the rest, so the rows of a tree (parents before children) cost one or two tokens of
matcher work each; masks are cached by prefix.

Usage:
    grammar = compile_grammar(GrammarSpec("json_schema", {"type": "object"}), tokenizer, vocab_size)
    constraint = grammar.constraint()        # one per request (it holds the matcher)
    logits = constraint(output_ids, logits)  # disallowed tokens -> -inf
    constraint.accepts(output_ids, token)    # for pruning drafts (logits_process.prune_tree)

Whitespace: JSON is generated compact (`, ` and `: ` separators, no other whitespace), so a
model cannot spend its tokens on indentation; `whitespace_flexible` in a schema's `x-guidance`
turns free whitespace back on.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from eyas.errors import EyasError

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NEG_INF_BITS = np.uint32(0xFF800000)  # float32 -inf
MASK_CACHE = 32  # masks kept per request, by prefix (a draft tree's rows fit)


class GrammarError(EyasError, ValueError):
    """A schema, regex or choice list that cannot be compiled into a grammar."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: kind in GRAMMAR_KINDS; value: the JSON schema (dict),
    None (json_object), the regex (str) or the choices (list of str)."""

    kind: str
    value: Any = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind '{self.kind}'; one of {', '.join(GRAMMAR_KINDS)}")

    def grammar_text(self) -> str:
        """The llguidance grammar (a JSON string); raises GrammarError for a bad value."""
        from llguidance import LLMatcher

        try:
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if self.kind == "json_schema":
                if not isinstance(self.value, dict):
                    raise GrammarError("a JSON schema must be a JSON object")
                return LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                if not isinstance(self.value, str):
                    raise GrammarError("a regex must be a string")
                return LLMatcher.grammar_from_regex(self.value)
            if not (isinstance(self.value, list) and self.value
                    and all(isinstance(choice, str) and choice for choice in self.value)):
                raise GrammarError("choices must be a non-empty list of non-empty strings")
            return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in self.value))
        except GrammarError:
            raise
        except Exception as error:  # llguidance raises ValueError on what it cannot read
            raise GrammarError(str(error)) from error


class Grammar:
    """A compiled, validated grammar for one tokenizer; `constraint()` per request."""

    def __init__(self, spec: GrammarSpec, text: str, tokenizer: Any, eos_token_ids: Sequence[int],
                 vocab_size: int) -> None:
        self.spec = spec
        self.text = text
        self.tokenizer = tokenizer  # llguidance's LLTokenizer
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.vocab_size = vocab_size

    def constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self)


_TOKENIZERS: dict[tuple[int, int, int], tuple[Any, Any]] = {}
_TOKENIZERS_LOCK = threading.Lock()


def guidance_tokenizer(tokenizer: Any, vocab_size: int, eos_token_id: int) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer (built once: about a second)."""
    import llguidance.hf

    key = (id(tokenizer), vocab_size, eos_token_id)
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(key)
        if cached is None or cached[0] is not tokenizer:
            cached = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                              eos_token=eos_token_id))
            _TOKENIZERS[key] = cached
    return cached[1]


def compile_grammar(spec: GrammarSpec, tokenizer: Any, vocab_size: int,
                    eos_token_ids: Sequence[int] | None = None) -> Grammar:
    """Compile and validate `spec` for a Hugging Face tokenizer; raises GrammarError naming
    what is wrong with the schema, regex or choices. vocab_size: the logits' width."""
    from llguidance import LLMatcher

    eos = sorted(set(eos_token_ids)) if eos_token_ids else [tokenizer.eos_token_id]
    guidance = guidance_tokenizer(tokenizer, vocab_size, eos[0])
    text = spec.grammar_text()
    problem = LLMatcher.validate_grammar(text, guidance)
    if problem:
        raise GrammarError(problem)
    return Grammar(spec, text, guidance, eos, vocab_size)


class GrammarConstraint:
    """The LogitsProcessor of one request under a grammar (see the module docstring)."""

    def __init__(self, grammar: Grammar) -> None:
        from llguidance import LLMatcher

        self.grammar = grammar
        self.matcher = LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.consumed: list[int] = []  # the ids the matcher stands after
        self.words = (grammar.vocab_size + 31) // 32
        self.masks: OrderedDict[tuple[int, ...], Tensor] = OrderedDict()  # prefix -> bias [V]
        self.eos = grammar.eos_token_ids
        self.mask_calls = 0  # masks computed (not from the cache)
        self.seconds = 0.0  # time spent masking and checking drafts (what the grammar costs)

    # ---- moving the matcher -----------------------------------------------------------
    def _seek(self, ids: Sequence[int]) -> bool:
        """Stand the matcher after `ids`; False (and standing after their longest valid
        prefix) when the grammar rejects one of them."""
        consumed = self.consumed
        common = 0
        if len(ids) >= len(consumed) and ids[: len(consumed)] == consumed:
            common = len(consumed)
        else:
            limit = min(len(ids), len(consumed))
            while common < limit and ids[common] == consumed[common]:
                common += 1
        if common < len(consumed):
            self.matcher.rollback(len(consumed) - common)
            del consumed[common:]
        rest = [self.eos[0] if token in self.eos else token for token in ids[common:]]
        if not rest:
            return True
        taken = self.matcher.try_consume_tokens(rest)
        consumed.extend(ids[common : common + taken])
        return taken == len(rest)

    def bias(self, ids: Sequence[int]) -> Tensor | None:
        """[V] float32: 0 where the grammar allows the token after `ids` (every EOS id where it
        may end), -inf elsewhere; None when `ids` themselves break the grammar (a draft path
        that pruning removes). Added to logits, it is the mask (one add, no masked fill)."""
        key = tuple(ids)
        cached = self.masks.get(key)
        if cached is not None:
            self.masks.move_to_end(key)
            return cached
        if not self._seek(ids):
            return None
        bitmask = np.empty(self.words, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, self.words * 4)
        self.mask_calls += 1
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: self.grammar.vocab_size]
        # 1 -> 0.0, 0 -> -inf, written as float32 bit patterns (an elementwise log or a
        # masked fill costs ~15x more here)
        bias = torch.from_numpy(((1 - bits.astype(np.uint32)) * NEG_INF_BITS).view(np.float32))
        if bits[self.eos[0]]:
            bias[self.eos] = 0.0
        self.masks[key] = bias
        if len(self.masks) > MASK_CACHE:
            self.masks.popitem(last=False)
        return bias

    def allowed(self, ids: Sequence[int]) -> Tensor | None:
        """[V] bool: the tokens the grammar allows after `ids`; None as for `bias`."""
        bias = self.bias(ids)
        return None if bias is None else bias == 0

    # ---- the LogitsProcessor protocol, and pruning ------------------------------------
    def __call__(self, ids: Sequence[int], logits: Tensor) -> Tensor:
        """logits [V]: tokens the grammar forbids after `ids` become -inf (in place). A row
        whose own path breaks the grammar is left as it is: it cannot be reached."""
        started = time.perf_counter()
        bias = self.bias(ids)
        if bias is not None:
            width = min(logits.shape[-1], bias.shape[0])
            logits[:width].add_(bias[:width])
            logits[width:] = float("-inf")
        self.seconds += time.perf_counter() - started
        return logits

    def accepts(self, ids: Sequence[int], token: int) -> bool:
        """Whether the grammar allows `token` after `ids`."""
        started = time.perf_counter()
        bias = self.bias(ids)
        self.seconds += time.perf_counter() - started
        return bias is not None and 0 <= token < bias.shape[0] and float(bias[token]) == 0.0

    def forced(self, ids: Sequence[int]) -> list[int]:
        """The tokens the grammar forces after `ids` (its mask allows one token at each), e.g.
        `{"name": ` at the start of an object: drafts that verification always accepts."""
        started = time.perf_counter()
        tokens = list(self.matcher.compute_ff_tokens()) if self._seek(ids) else []
        self.seconds += time.perf_counter() - started
        return tokens

    def finished(self, ids: Sequence[int]) -> bool:
        """Whether the output `ids` is complete under the grammar (it may end here)."""
        return self._seek(ids) and self.matcher.is_accepting()

