"""Teacher-forced measurements over one split: the target's greedy answers to the prompts, then
one target pass per conversation, the head unrolled on the target's features, and layer-skip
drafts over the same tokens.

Every statistic is over the same positions: the target rows that predict an answer token
(row j predicts token j + 1). The head's step 0 at row t reads the target's feature of t and
token t + 1, and is scored against the target's row t + 1 (docs/training.md, "Training-time
test"), so its first-step positions are exactly these rows.

Usage:
    sequences = greedy_answers(target, conversations, max_tokens=96)
    split = measure_split(target, head, lm_head_weight, sequences, ttt_steps=5, skip_counts=(1, 2, 4))
    split.target_argmax, split.top1, split.head_first_hits, split.head_correct, split.skip_hits
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from eyas.data.records import Conversation
from eyas.eagle3.head import Eagle3Head
from eyas.engine.target import Target
from eyas.training.ttt import TrainingTimeTest, shift_left, target_distribution, ttt_attention_mask


@dataclass
class Sequence:
    prompt: list[int]
    answer: list[int]  # the target's greedy answer (its end-of-turn token included when it stopped)


@dataclass
class SplitMeasure:
    """Per-position arrays, concatenated over the split's conversations (N positions)."""

    sequences: int
    prompt_tokens: int
    target_argmax: Tensor  # int64 [N] the target's greedy token
    top1: Tensor  # float32 [N] the target's probability of it
    generated_match: Tensor  # bool [N] that token equals the one greedy decoding wrote
    head_first_hits: Tensor  # bool [N] the head's step-0 top-1 (a target id) equals it
    head_correct: Tensor  # int64 [K] rows right at each TTT step
    head_counted: Tensor  # int64 [K] rows scored at each TTT step
    skip_hits: dict[tuple[int, ...], Tensor] = field(default_factory=dict)  # skipped layers -> bool [N]
    influence: list[float] = field(default_factory=list)  # block influence of each decoder layer


@torch.inference_mode()
def greedy_answers(target: Target, conversations: list[Conversation], max_tokens: int,
                   batch_size: int = 8) -> list[Sequence]:
    """The target's greedy answers to each conversation's first user turn (prompts rendered as
    `eyas data regenerate` renders them), decoded in batches of similar prompt length."""
    from eyas.data.regenerate import prompt_history
    from eyas.data.templates import render_prompt
    from eyas.engine.generate import generate_batch
    from eyas.engine.sampling import SamplingParams

    prompts = []
    for conversation in conversations:
        history, user_turns = prompt_history(conversation)
        prompts.append(render_prompt(target.tokenizer, history + [{"role": "user", "content": user_turns[0]}]))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: dict[int, list[int]] = {}
    params = SamplingParams(max_tokens=max_tokens)
    end_of_turn = target.tokenizer.eos_token_id
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        for index, result in zip(chunk, generate_batch(target, [prompts[i] for i in chunk], params)):
            stopped = result.finish_reason == "stop" and end_of_turn is not None
            answers[index] = list(result.token_ids) + ([end_of_turn] if stopped else [])
    return [Sequence(prompts[i], answers[i]) for i in range(len(prompts)) if answers[i]]


def head_first_step(head: Eagle3Head, taps: Tensor, ids: Tensor, first_row: int) -> Tensor:
    """The head's step-0 draft (target ids) [T - 2 - first_row] at rows first_row..T-3, which are
    scored against the target's rows first_row + 1..T-2.  taps [1, T, 3H], ids [1, T]."""
    length = ids.shape[1]
    positions = torch.arange(length, device=ids.device)[None]
    out = head(taps, shift_left(ids, 1), positions, attn_mask=ttt_attention_mask(length, 0, ids.device),
               compute_logits=False)
    logits = head.compute_logits(out.hidden[0, first_row:length - 2])  # [M, N]
    return head.draft_to_target(logits.argmax(-1))


def block_influence_sums(residuals: Tensor, rows: Tensor) -> Tensor:
    """Sum over `rows` of 1 - cos(residual entering, residual leaving) per layer: [L].
    residuals [T, L + 1, H]."""
    picked = residuals[rows].float()  # [N, L + 1, H]
    cosine = torch.cosine_similarity(picked[:, :-1], picked[:, 1:], dim=-1)  # [N, L]
    return (1.0 - cosine).sum(0)


@torch.inference_mode()
def measure_split(target: Target, head: Eagle3Head, lm_head_weight: Tensor,
                  sequences: list[Sequence], ttt_steps: int,
                  skip_counts: tuple[int, ...] = ()) -> SplitMeasure:
    """lm_head_weight [V, H] float32: the target's output layer (its logits = hidden @ W.T).
    skip_counts: layer-skip drafts that leave out the n decoder layers of least block influence
    on these positions, for each n (none: no layer-skip measurement)."""
    model, num_layers = target.model, target.config.num_hidden_layers
    hidden_size = target.config.hidden_size
    head_layers = list(head.config.target_layer_ids)
    boundaries = list(range(num_layers + 1)) if skip_counts else head_layers
    ttt = TrainingTimeTest(head, ttt_steps)
    vocab = head.draft_vocab
    argmaxes, top1s, matches, hits = [], [], [], []
    correct = torch.zeros(ttt_steps, dtype=torch.int64)
    counted = torch.zeros(ttt_steps, dtype=torch.int64)
    influence = torch.zeros(num_layers)
    for sequence in sequences:
        # 1. One target pass: the taps, the last hidden state, its logits at the answer rows.
        ids = torch.tensor([sequence.prompt + sequence.answer], device=target.device)  # [1, T]
        length, first = ids.shape[1], len(sequence.prompt) - 1
        rows = torch.arange(first, length - 1, device=target.device)  # predict answer tokens
        out = model(ids, tap_layers=tuple(boundaries), logits_at=None)
        hidden = out.hidden.float()  # [1, T, H]
        logits = hidden[0, rows] @ lm_head_weight.T  # [N_seq, V]
        probs = torch.softmax(logits, dim=-1)
        top1, best = probs.max(dim=-1)
        argmaxes.append(best.cpu())
        top1s.append(top1.cpu())
        matches.append((best == ids[0, rows + 1]).cpu())
        taps = out.taps.float().view(1, length, len(boundaries), hidden_size)  # [1, T, B, H]
        if skip_counts:
            influence += block_influence_sums(taps[0], rows).cpu()
        head_taps = taps[:, :, [boundaries.index(b) for b in head_layers]].reshape(1, length, -1)
        head_taps = head_taps.to(head.dtype)
        # 2. The head: its first step row by row, then all K steps as training scores them.
        hits.append((head_first_step(head, head_taps, ids, first - 1) == best).cpu())
        loss_mask = torch.zeros_like(ids)
        loss_mask[0, len(sequence.prompt):] = 1
        distribution = target_distribution(hidden.to(head.dtype), lm_head_weight, vocab)
        result = ttt(head_taps, ids, loss_mask, distribution)
        correct += result.correct.cpu()
        counted += result.counted.cpu()
    split = SplitMeasure(sequences=len(sequences),
                         prompt_tokens=sum(len(s.prompt) for s in sequences),
                         target_argmax=torch.cat(argmaxes), top1=torch.cat(top1s),
                         generated_match=torch.cat(matches), head_first_hits=torch.cat(hits),
                         head_correct=correct, head_counted=counted)
    if skip_counts:
        # 3. Layer-skip drafts, teacher-forced: the target without the n least influential layers
        #    runs over the same tokens (its context computed by itself, as its own cache holds it).
        split.influence = (influence / split.target_argmax.numel()).tolist()
        ranked = sorted(range(num_layers), key=lambda layer: (split.influence[layer], layer))
        for count in skip_counts:
            skip = tuple(sorted(ranked[:count]))
            split.skip_hits[skip] = skip_draft_tokens(target, lm_head_weight, sequences, skip) == split.target_argmax
    return split


@torch.inference_mode()
def skip_draft_tokens(target: Target, lm_head_weight: Tensor, sequences: list[Sequence],
                      skip: tuple[int, ...]) -> Tensor:
    """int64 [N]: the greedy token of the target without the decoder layers `skip` at each
    position (the rows that predict answer tokens, concatenated over the sequences)."""
    tokens = []
    for sequence in sequences:
        ids = torch.tensor([sequence.prompt + sequence.answer], device=target.device)
        rows = torch.arange(len(sequence.prompt) - 1, ids.shape[1] - 1, device=target.device)
        hidden = target.model(ids, logits_at=None, skip_layers=frozenset(skip)).hidden[0, rows]
        tokens.append((hidden.float() @ lm_head_weight.T).argmax(-1).cpu())
    return torch.cat(tokens)
