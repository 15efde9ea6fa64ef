"""`model`: a separate, smaller draft model with the target's tokenizer; `self`: the target
drafts for itself (for tests: every greedy draft is accepted).

The draft model keeps its own KV cache. It drafts a chain of k tokens autoregressively
(greedy: argmax; sampling whose tokens are the target's Gumbel draws: the draft's own draw with
the noise of the position it fills, a deterministic chain (`draw_with`, coupled_draws.py);
other sampling: drawn from its own distribution under the same temperature, top-k and top-p,
with those probabilities handed to the verifier). After verification its cache is
rolled back to the longest prefix that is still valid: nothing is recomputed.

Priced (`priced=True`, what `--draft model:`, `layerskip` and `self` build): in single-stream
decoding with the never-slower fallback on (`single_stream`) the chain's length is chosen each step from measured costs and observed
acceptance (chain_pricing.py), 0 (a plain step, no draft pass) where no chain pays, so that a
pair that cannot pay decodes at plain speed. A priced draft never reads the whole prompt: its
first chain, like a probe after plain steps, reads the last `catch_up_window` tokens (below),
so a request that the pair never drafts in costs nothing and a short answer does not have to
earn back a read of its prompt (Qwen2.5-Coder-1.5B with its 0.5B, 6 x 64 tokens, 1 thread, CPU
time: MT-Bench 0.94x plain median with the prompt read whole, 1.15x from the window; code
1.23-1.24x and 1.18-1.20x, its drafts accepted a little less from the shorter context; a first
window of 128 tokens: 1.02x and 1.17x).

Priced, a catch-up longer than `catch_up_window` tokens (a probe after a stretch of plain
steps, the first chain of a request) restarts the draft's
cache from the last `catch_up_window` tokens of the context, at positions from 0: it drafts
from that window alone (RoPE attention depends only on relative positions), and a probe costs
a window's pass instead of the whole context's. The same restart lets a draft with a shorter
context than the target's go on drafting. Output is unchanged: the target verifies every draft.

The prices are measured in this thread's CPU seconds (`time.thread_time`: a step from the end
of the one before, each draft pass alone), not in wall time: on a shared machine the waits for a
core fall on whichever pass is running and, counted, priced a draft out for whole requests
(one busy stretch measured its passes at 6x their price while plain steps had been measured
before it). With more threads the calling thread's CPU time still covers each whole pass (its
share of the work, then its wait for the other threads), so a draft whose small passes spread
worse over the threads than the target's is priced at what it costs there.

`layerskip` (layerskip.py) is this proposer with the target as its own draft, some decoder
layers left out.
"""

from __future__ import annotations

import time
from typing import Collection

import numpy as np
import torch

from eyas.engine.gumbel import sample_rows
from eyas.engine.sampling import SamplingParams, sample_from, target_probs
from eyas.engine.speculative.draft import DraftTree, VerifyResult
from eyas.engine.speculative.proposers.chain_pricing import ChainPricing
from eyas.engine.speculative.proposers.draft_vocabulary import DraftVocabulary
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.models.kv_cache import LayerSubsetKVCache
from eyas.models.llama import ForwardOutput

INITIAL_SPARE_SLOTS = 256  # draft cache slots beyond the prompt at the start of a request
CATCH_UP_WINDOW = 32  # the most tokens one catch-up feeds the draft (module docstring)


def check_same_tokenizer(target: Target, draft: Target) -> None:
    a, b = target.tokenizer, draft.tokenizer
    probe = "Speculative decoding: 123 tokens, déjà vu! <|im_end|>"
    if len(a) != len(b) or a.get_vocab() != b.get_vocab() or a(probe)["input_ids"] != b(probe)["input_ids"]:
        raise EyasError(
            f"the draft model's tokenizer differs from the target's ({len(b)} vs {len(a)} tokens); "
            "a draft model must share the target's tokenizer"
        )


class DraftModelProposer:
    """A chain from a draft model with its own KV cache (see the module docstring).

    `skip_layers` runs the draft without those decoder layers (layer-skip self-speculation:
    the draft is the target itself); its cache then holds only the layers that run.
    `min_confidence` ends the chain early at a draft token whose probability under the draft
    is below it (0 = always draft the full budget); `max_draft_tokens` caps the chain.
    `priced` sizes the chain from measured costs in single-stream decoding (module docstring).
    `vocabulary_size` > 0: greedy drafts are the argmax over the first that many token ids and
    the special tokens (draft_vocabulary.py), where the draft's vocabulary is far larger.
    `catch_up_window`: a longer catch-up restarts the cache from that many last tokens (module
    docstring); None: CATCH_UP_WINDOW where priced, else every catch-up reads the whole context
    (an unpriced draft reads the prompt at its first step, as every step drafts).
    """

    tap_layers: tuple[int, ...] = ()

    def __init__(self, draft: Target, name: str = "model", slots: int = 4096,
                 skip_layers: Collection[int] = (), min_confidence: float = 0.0,
                 max_draft_tokens: int | None = None, priced: bool = False,
                 vocabulary_size: int = 0, catch_up_window: int | None = None) -> None:
        if catch_up_window is not None and catch_up_window < 1:
            raise ValueError(f"catch_up_window must be at least 1, got {catch_up_window}")
        self.draft = draft
        self.name = name
        self.slots = slots  # the most slots the draft cache may grow to
        self.skip_layers = frozenset(skip_layers)
        self.min_confidence = min_confidence
        self.max_draft_tokens = max_draft_tokens
        self.cache: LayerSubsetKVCache | None = None
        self.catch_up_window = catch_up_window
        self.cached_ids: list[int] = []  # tokens whose keys/values are in the draft cache
        self.offset = 0  # the context index of cached_ids[0] (slot 0, position 0)
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self.checked_targets: set[int] = set()
        self.priced = priced
        self.pricing: ChainPricing | None = None  # single_stream, priced only
        self.pass_seconds = 0.0  # draft passes of the last propose(), catch-up included (CPU)
        self.step_clock = 0.0  # this thread's CPU seconds when the last step ended
        self.after_prefill = False  # the next step follows the prefill: not a price
        self.vocabulary = DraftVocabulary.build(draft, vocabulary_size) if vocabulary_size > 0 else None
        self.coupling = None  # CoupledDraws of a request whose tokens are Gumbel draws (draw_with)
        self._step_pass: float | None = None  # CPU seconds of the last pass when a step's (one row)

    def single_stream(self, target: Target, fallback: bool = True) -> None:
        """Decoding one request (speculative_generate): a priced proposer gets the measured
        costs of the target's passes and of the draft's (cached per machine; the serving
        engine never calls this). Pricing is part of the never-slower rule: with `fallback`
        off (`eyas eval` by default, PolicyConfig(enabled=False)) every step drafts the budget,
        so that the method itself is measured."""
        if not fallback:
            self.pricing = None
        elif self.priced and self.pricing is None:
            from eyas.engine.speculative.sizing import load_or_measure

            draft_pass = load_or_measure(self.draft, sizes=(1, 2)).verify(1)
            if self.skip_layers:  # the layers that run, a first price that measured passes correct
                layers = self.draft.config.num_hidden_layers
                draft_pass *= (layers - len(self.skip_layers)) / layers
            self.pricing = ChainPricing(load_or_measure(target), draft_pass)

    def step_seconds(self, size: int, seconds: float) -> None:
        """A decode step that verified `size` draft tokens (0: plain) ended: its CPU seconds
        since the last one ended, against the prices (single_stream only; the wall `seconds`
        are the fallback judge's, policy.py)."""
        pricing = self.pricing
        if pricing is None:
            return
        now = time.thread_time()
        seconds, self.step_clock = now - self.step_clock, now
        if self.after_prefill:  # right after the prefill: dearer than a steady step
            self.after_prefill = False
        elif size:
            pricing.measured("verify", seconds - self.pass_seconds, pricing.cost.verify(size + 1))
        else:
            pricing.measured("plain", seconds, pricing.cost.verify(1))
        self.pass_seconds = 0.0

    def stats(self) -> dict:
        return {} if self.pricing is None else self.pricing.stats()

    def begin(self, target: Target, prompt_ids: list[int], params: SamplingParams) -> None:
        if self.draft is not target and id(target) not in self.checked_targets:
            check_same_tokenizer(target, self.draft)
            self.checked_targets = self.checked_targets | {id(target)}  # copies share no set
        self.params = params
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=self.draft.device).manual_seed(params.seed + 7919)
        # Room for what the first catch-up reads (a priced draft: a window, not the prompt) and
        # a first stretch of output; grown (doubled) on demand.
        first_read = CATCH_UP_WINDOW if self.pricing is not None else len(prompt_ids)
        self.cache = self._new_cache(min(self.slot_limit, (self.catch_up_window or first_read) + INITIAL_SPARE_SLOTS))
        self.cached_ids, self.offset = [], 0
        self.after_prefill = True
        self.coupling = None
        if self.pricing is not None:  # whether it explores; the draft reads no prompt (docstring)
            self.pricing.new_request(self.max_draft_tokens or 8)

    def draw_with(self, coupling) -> None:
        """This request's tokens are Gumbel draws with known noise (coupled_draws.py): each
        draft token is the draft's own draw with the noise of the position it fills, a
        deterministic chain that the target accepts wherever it draws the same token (no
        probabilities are computed, so `min_confidence` does not end such a chain)."""
        self.coupling = coupling

    @property
    def slot_limit(self) -> int:
        return min(self.slots, self.draft.config.context_length)

    def _new_cache(self, slots: int) -> LayerSubsetKVCache:
        config = self.draft.config
        kept = [i for i in range(config.num_hidden_layers) if i not in self.skip_layers]
        return LayerSubsetKVCache(kept, 1, config.num_key_value_heads, slots, config.head_dim,
                                  dtype=self.draft.kv_dtype, device=self.draft.device)

    def _ensure_slots(self, needed: int) -> None:
        if needed > self.cache.max_slots:
            self.cache = self.cache.grown(min(self.slot_limit, max(needed, 2 * self.cache.max_slots)))

    def _argmax_only(self) -> bool:
        return self.params.greedy and self.min_confidence <= 0

    def _forward(self, ids: list[int], write_at: int) -> torch.Tensor | int:
        """Feed `ids` at slots write_at..; the draft's logits [1, V] after the last one (greedy
        with a vocabulary subset: the subset's [1, N], whose argmax `vocabulary.token` maps,
        or that token itself as an int where `_next_token` finds it; coupled draws: the last
        row's hidden state [1, H], which `_coupled_draw` draws from)."""
        # greedy drafting needs only the argmax: the screened output layer gives it exactly at
        # int8 cost (a 150k-token vocabulary in float32 would cost more than the draft's layers)
        argmax_only = self._argmax_only()
        subset = self.vocabulary if argmax_only else None
        hidden_only = subset is not None or self.coupling is not None
        started = time.thread_time()
        logits = self._next_token(ids, write_at) if argmax_only and self.coupling is None else None
        if logits is None:
            tensor = torch.tensor([ids], device=self.draft.device)
            out = self.draft.model(tensor, cache=self.cache, write_at=write_at,
                                   logits_at=None if hidden_only else "last", skip_layers=self.skip_layers,
                                   greedy=argmax_only)
            if self.coupling is not None:
                logits = out.hidden[:, -1]
            else:
                logits = subset.logits(out.hidden[:, -1]) if subset else out.logits[:, -1]
        seconds = time.thread_time() - started
        self.pass_seconds += seconds
        self._step_pass = seconds if len(ids) <= 2 else None  # a step's pass, not a catch-up's
        if self.pricing is not None and self._step_pass is not None and self.coupling is None:
            self.pricing.measured("draft", seconds, self.pricing.draft_pass)  # coupled: with its draw
        return logits

    def _next_token(self, ids: list[int], write_at: int) -> int | None:
        """The greedy draft token after feeding `ids` at slots write_at.., through the fused
        stack's single-stream call and the screen's argmax (the vocabulary subset's where there
        is one: Transformer.decode_rows, greedy_tokens; the same bits as `forward` and
        `logits`, without ~0.4 ms a token of small PyTorch ops running cold after the draft's
        pass, AMD Zen 4, Qwen2.5-Coder-0.5B). None where that path does not run (skipped
        layers, another precision)."""
        model = self.draft.model
        if self.skip_layers or not hasattr(model, "decode_rows"):
            return None
        count = len(ids)
        mask = None  # one token sees every slot up to its own; several, the causal rows below
        if count > 1:
            mask = torch.from_numpy(np.tri(count, write_at + count, k=write_at, dtype=bool)[None])
        out = model.decode_rows(ids, list(range(write_at, write_at + count)), write_at, mask, self.cache)
        if out is None:
            return None
        hidden = out.hidden if count == 1 else out.hidden[0, -1:]
        if self.vocabulary is None:
            return model.greedy_tokens(hidden)[-1]
        return self.vocabulary.token(self.vocabulary.layer.greedy_tokens(hidden)[-1])

    def _common_prefix(self, token_ids: list[int]) -> int:
        """Slots of the cache that still hold token_ids[offset:] (the root is always fed again)."""
        window = token_ids[self.offset:]
        limit = min(len(self.cached_ids), len(window) - 1)
        for index in range(limit):
            if self.cached_ids[index] != window[index]:
                return index
        return limit

    def _catch_up_from(self, token_ids: list[int], max_nodes: int) -> int:
        """The first slot to feed; restarts the cache from the last `catch_up_window` tokens
        where the catch-up would be longer or the chain would not fit the draft's slots."""
        window = self.catch_up_window or (CATCH_UP_WINDOW if self.pricing is not None else None)
        seen = len(token_ids) - self.offset
        valid = self._common_prefix(token_ids) if seen > 0 else 0
        longer = window is not None and seen - valid > window
        if seen <= 0 or longer or seen + max_nodes >= self.slot_limit:
            window = window or CATCH_UP_WINDOW
            self.offset, self.cached_ids, valid = max(0, len(token_ids) - window), [], 0
        return valid

    @torch.inference_mode()
    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        if self.max_draft_tokens is not None:
            max_nodes = min(max_nodes, self.max_draft_tokens)
        self.pass_seconds = 0.0
        if self.pricing is not None:
            max_nodes = self.pricing.length(max_nodes)
        if max_nodes <= 0:
            return DraftTree.empty()
        # 1. Catch up: feed what the cache has not seen (at least the root), or restart it from
        #    a window. Slots past the valid prefix hold keys of rejected drafts or of an earlier
        #    window; they are overwritten before being read.
        valid = self._catch_up_from(token_ids, max_nodes)
        seen = len(token_ids) - self.offset  # context tokens in the cache after the catch-up
        if seen + max_nodes >= self.slot_limit:
            return DraftTree.empty()
        self._ensure_slots(seen + max_nodes)
        logits = self._forward(token_ids[self.offset + valid:], valid)
        self.cached_ids = token_ids[self.offset:]
        # 2. Draft a chain, feeding each draft token but the last.
        drafts: list[int] = []
        probs_rows: list[torch.Tensor] = []
        for step in range(max_nodes):
            if self.coupling is not None:  # logits holds the last row's hidden state
                token = self._coupled_draw(logits, len(token_ids) + step)
            elif isinstance(logits, int):  # the greedy token itself (_next_token)
                token = logits
            elif self.params.greedy:
                if self.min_confidence > 0:
                    confidence = float(torch.softmax(logits.float(), dim=-1).max())
                    if confidence < self.min_confidence:
                        break
                token = int(logits.argmax(dim=-1))
                if self.vocabulary is not None and self._argmax_only():
                    token = self.vocabulary.token(token)
            else:
                probs = target_probs(logits, self.params)[0]  # [V]
                if self.min_confidence > 0 and float(probs.max()) < self.min_confidence:
                    break
                token = int(sample_from(probs[None], self.generator))
                probs_rows.append(probs)
            drafts.append(token)
            if step + 1 < max_nodes:
                logits = self._forward([token], len(self.cached_ids))
                self.cached_ids.append(token)
        probs = torch.stack(probs_rows) if probs_rows else None
        return DraftTree.chain(drafts, probs)

    def _coupled_draw(self, hidden: torch.Tensor, context: int) -> int:
        """The draft's draw for the token after `context` tokens, hidden [1, H]: with the noise
        of the position it fills, through its own output screen (gumbel.sample_rows), exactly
        as the target draws that position from its own hidden state; with a vocabulary subset,
        the subset's draw (DraftVocabulary.draw: a token outside it is never drafted)."""
        coupling = self.coupling
        key = coupling.key(coupling.position(context, 1))
        started = time.thread_time()
        subset = self.vocabulary
        if subset is not None and subset.screened_in_extension:  # the subset's screen, as greedy drafts
            token = subset.draw(hidden, coupling.inverse_temperature, key)
        else:
            scale = torch.tensor([coupling.inverse_temperature], dtype=torch.float32)
            token = int(sample_rows(self.draft.model.lm_head, hidden, scale, torch.tensor([key]))[0])
        seconds = time.thread_time() - started
        self.pass_seconds += seconds
        if self.pricing is not None and self._step_pass is not None:  # the pass and its draw
            self.pricing.measured("draft", self._step_pass + seconds, self.pricing.draft_pass)
        return token

    def observe(self, tree: DraftTree, result: VerifyResult | None,
                output: ForwardOutput | None) -> None:
        # the next propose() finds the valid prefix by comparing token ids
        if self.pricing is not None and result is not None:
            if tree.size:
                self.pricing.record(tree.size, len(result.accepted_nodes))
            self.pricing.relax()
