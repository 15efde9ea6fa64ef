"""Training-time test (TTT): the head unrolled K steps on its own outputs, as it drafts.

Alignment (T tokens x_0..x_{T-1}; f_t = fused target feature at t; target row j predicts x_{j+1}):

    step k, row t:  hidden  = f_t (k = 0) or the head's row-t output of step k-1
                    token   = x_{t+1+k}                     position = t + k
                    target  = softmax(target logits of row t+1+k restricted to the draft vocab)
                    weight  = loss_mask[t+2+k] * t2d[argmax target logits of row t+1+k]

i.e. inputs, targets and masks shift left by one per step while the hidden state stays in its
row. Attention at step k: query t sees step-0 keys <= t (causal) plus its own keys of steps 1..k
(the diagonal); the keys of all steps are concatenated, [T, (k+1) T].

    loss_k = -sum_rows weight * sum_v p_v log q_v        (a sum; the trainer normalizes it)
    loss   = sum_k decay^k loss_k / (answer tokens in the global batch)
    acc_k  = rows where argmax q (a draft id) == argmax p and the target token is drafted
             / answer rows at step k   (tokens outside the draft vocab count as misses)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.vocab import DraftVocab
from eyas.training.label_screen import OtherRowsScreen


def ttt_attention_mask(length: int, step: int, device: torch.device | str = "cpu") -> Tensor:
    """[T, (step + 1) * T] bool: step-0 keys causally, then the diagonal of each later step."""
    every = torch.arange(length, device=device)
    return unroll_attention_mask([every] * (step + 1))


def unroll_attention_mask(columns: list[Tensor]) -> Tensor:
    """[T_k, T_0 + ... + T_k] bool for step k = len(columns) - 1 of an unroll that runs, at step
    j, the rows columns[j] (increasing time indices; columns[0] = every row, the keys of step 0):
    a query row t sees the step-0 keys <= t and its own keys of steps 1..k."""
    query = columns[-1][:, None]  # [T_k, 1]
    parts = [columns[0][None] <= query] + [later[None] == query for later in columns[1:]]
    return torch.cat(parts, dim=1)


def shift_left(x: Tensor, count: int = 1) -> Tensor:
    """Shift along dim 1 (time) by `count`, filling the end with zeros."""
    out = torch.zeros_like(x)
    if count < x.shape[1]:
        out[:, : x.shape[1] - count] = x[:, count:]
    return out


class TargetOutputLayer:
    """The target's output layer [V, H] in float32, split by the draft vocabulary: its N kept rows
    give the distribution; the V - N others matter only to the argmax (is the target's top token
    drafted at all), which depends on the sample alone and is kept between epochs (TargetLabels).

    screen: answer that question from a bfloat16 product with a proven error bound first
    (OtherRowsScreen: the same labels, for CPUs whose bfloat16 matmuls are fast)."""

    def __init__(self, weight: Tensor, vocab: DraftVocab, screen: bool = False) -> None:
        weight = weight.float()
        t2d = vocab.t2d.to(weight.device)
        self.kept = weight[t2d].contiguous()  # [N, H], in draft-id order (kept ids increase)
        self.other = weight[~t2d].contiguous()  # [V - N, H]
        self.kept_ids = vocab.kept_ids.to(weight.device)  # [N] target ids
        self.other_ids = (~t2d).nonzero().squeeze(1)  # [V - N] target ids
        self.screen = OtherRowsScreen(self.other) if screen and self.other.numel() else None


@dataclass
class TargetLabels:
    in_draft: Tensor  # [B, T] bool: the target's argmax at row t lies in the draft vocabulary
    argmax_draft: Tensor  # [B, T] int64: that argmax as a draft id (0 where not in_draft)


@dataclass
class TargetDistribution:
    probs: Tensor  # [B, T, N] float32: target softmax over the draft vocabulary, row t -> x_{t+1}
    in_draft: Tensor  # [B, T] bool: the target's argmax at row t lies in the draft vocabulary
    argmax_draft: Tensor  # [B, T] int64: that argmax as a draft id (0 where not in_draft)

    @property
    def labels(self) -> TargetLabels:
        return TargetLabels(self.in_draft, self.argmax_draft)


def hard_labels(target: TargetDistribution) -> TargetDistribution:
    """The same target with its distribution replaced by the one-hot of its argmax (zero rows
    where the argmax is not drafted: those rows weigh nothing in the loss anyway)."""
    onehot = F.one_hot(target.argmax_draft, target.probs.shape[-1]).to(target.probs.dtype)  # [B, T, N]
    onehot *= target.in_draft[..., None]
    return TargetDistribution(onehot, target.in_draft, target.argmax_draft)


@torch.no_grad()
def target_distribution(hidden: Tensor, lm_head: Tensor | TargetOutputLayer, vocab: DraftVocab,
                        chunk_tokens: int = 1024, rows: Tensor | None = None,
                        labels: TargetLabels | None = None) -> TargetDistribution:
    """The target's next-token distribution from its last hidden state [B, T, H] (after the
    final norm) and lm_head ([V, H], or split once by TargetOutputLayer), in float32, restricted
    to the draft vocabulary.

    rows: [B, T] bool, the rows that are read (scored_target_rows); the others are left at zero
    (probs 0, not in the draft vocabulary), which saves the full-vocabulary output layer there.
    labels: the argmax of an earlier call on the same hidden states and rows (`.labels`); only
    the draft vocabulary's rows of the output layer run then (N of V).
    """
    device = hidden.device
    layer = lm_head if isinstance(lm_head, TargetOutputLayer) else TargetOutputLayer(lm_head.to(device), vocab)
    shape = hidden.shape[:2]
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B*T, H]
    picked = None if rows is None else rows.reshape(-1).nonzero().squeeze(1)  # [R]
    if picked is not None:
        flat = flat[picked]
    in_bf16 = flat.dtype == torch.bfloat16  # offline features: no rounding for the screen
    flat = flat.float()
    probs, in_draft, argmax_draft = [], [], []
    for start in range(0, flat.shape[0], chunk_tokens):
        chunk = flat[start:start + chunk_tokens]  # [c, H]
        logits = chunk @ layer.kept.T  # [c, N]
        probs.append(torch.softmax(logits, dim=-1))
        if labels is None:  # the argmax over the whole vocabulary, first index on ties
            best = logits.argmax(-1)  # [c] draft ids
            value = logits.gather(1, best[:, None]).squeeze(1)
            drafted = torch.ones_like(best, dtype=torch.bool)
            if layer.other.numel():
                # rows the screen settles skip the float32 product
                unsure: slice | Tensor = slice(None)
                if layer.screen is not None:
                    known, drafted = layer.screen.resolve(chunk, value, in_bf16)
                    unsure = (~known).nonzero().squeeze(1)  # [u] rows
                others = chunk[unsure] @ layer.other.T  # [u, V - N]
                other_best = others.argmax(-1)
                other_value = others.gather(1, other_best[:, None]).squeeze(1)
                drafted[unsure] = (value[unsure] > other_value) | (
                    (value[unsure] == other_value) & (layer.kept_ids[best[unsure]] < layer.other_ids[other_best]))
            in_draft.append(drafted)
            argmax_draft.append(torch.where(drafted, best, 0))
    if not probs:  # no row is read
        probs.append(flat.new_zeros(0, layer.kept.shape[0]))
        in_draft.append(torch.zeros(0, dtype=torch.bool, device=device))
        argmax_draft.append(torch.zeros(0, dtype=torch.int64, device=device))
    if picked is None:
        full_probs = torch.cat(probs).view(*shape, -1)
        if labels is not None:
            return TargetDistribution(full_probs, labels.in_draft.to(device), labels.argmax_draft.to(device))
        return TargetDistribution(probs=full_probs, in_draft=torch.cat(in_draft).view(shape),
                                  argmax_draft=torch.cat(argmax_draft).view(shape))
    # Scatter the computed rows back into [B, T] tensors.
    total = shape[0] * shape[1]
    full_probs = flat.new_zeros(total, layer.kept.shape[0])
    full_probs[picked] = torch.cat(probs)
    if labels is not None:
        return TargetDistribution(full_probs.view(*shape, -1), labels.in_draft.to(device),
                                  labels.argmax_draft.to(device))
    full_in_draft = torch.zeros(total, dtype=torch.bool, device=device)
    full_in_draft[picked] = torch.cat(in_draft)
    full_argmax = torch.zeros(total, dtype=torch.int64, device=device)
    full_argmax[picked] = torch.cat(argmax_draft)
    return TargetDistribution(probs=full_probs.view(*shape, -1), in_draft=full_in_draft.view(shape),
                              argmax_draft=full_argmax.view(shape))


def scored_target_rows(loss_mask: Tensor, steps: int) -> Tensor:
    """[B, T] bool: the target rows that a K-step unroll reads, t + 1 + k for every answer
    row t (loss_mask[t + 2] == 1) and step k < K; the target distribution is needed only there."""
    answer = shift_left(loss_mask, 2).bool()  # [B, T]
    rows = torch.zeros_like(answer)
    length = answer.shape[1]
    for offset in range(1, steps + 1):
        if offset < length:
            rows[:, offset:] |= answer[:, : length - offset]
    return rows


def score_each_row(logits: Tensor, target: TargetDistribution, rows: Tensor,
                   target_times: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: soft cross-entropy [M] and hit [M] bool of draft logits [M, N] against the
    target's distribution at (rows, target_times) [M] each. A target argmax outside the draft
    vocabulary weighs nothing in the loss and counts as a miss (the head cannot draft it)."""
    logits = logits.float()  # bfloat16 under autocast: widened once (exact), argmax on the same values
    log_q = F.log_softmax(logits, dim=-1)
    drafted = target.in_draft[rows, target_times]  # [M]
    probs = target.probs[rows, target_times]  # [M, N]
    losses = -(drafted.float() * (probs * log_q).sum(-1))
    hits = (logits.argmax(-1) == target.argmax_draft[rows, target_times]) & drafted
    return losses, hits


def score_rows(logits: Tensor, target: TargetDistribution, rows: Tensor,
               target_times: Tensor) -> tuple[Tensor, Tensor]:
    """Soft cross-entropy sum and correct count of draft logits [M, N] (score_each_row, summed)."""
    losses, hits = score_each_row(logits, target, rows, target_times)
    return losses.sum(), hits.sum()


def answer_count(loss_mask: Tensor) -> Tensor:
    """Answer rows at step 0 (rows t with loss_mask[t + 2] == 1): the loss normalizer's share."""
    return shift_left(loss_mask, 2).sum()


@dataclass
class TTTResult:
    loss_sums: Tensor  # [K] sum over rows of weight * cross-entropy (carries the graph)
    correct: Tensor  # [K] rows where the draft's argmax equals the target's
    counted: Tensor  # [K] answer rows at each step (the accuracy denominator)


class TrainingTimeTest(nn.Module):
    """The whole K-step unroll as one module, so that DDP sees one forward per backward."""

    def __init__(self, head: Eagle3Head, steps: int, row_multiple: int = 1) -> None:
        super().__init__()
        self.head = head
        self.steps = steps
        # Rows per step and scored rows rounded up to this (unscored rows fill them): few
        # matmul shapes, for backends that prepare a kernel per shape (oneDNN's bfloat16 on a
        # CPU: ~3.5 ms for each new one, against 0.13 ms for the product itself).
        self.row_multiple = row_multiple

    def forward(
        self,
        taps: Tensor,  # [B, T, 3*Ht] fused-taps input of step 0
        input_ids: Tensor,  # [B, T] int64, right-padded
        loss_mask: Tensor,  # [B, T] 0/1
        target: TargetDistribution,
    ) -> TTTResult:
        batch, length = input_ids.shape
        device = input_ids.device
        # 1. Step-0 alignment: row t reads token t+1 and learns the target's row t+1, counted when
        #    token t+2 is an answer token; at step k the same row is scored when token t+2+k is.
        answers = [shift_left(loss_mask, 2 + step).bool() for step in range(self.steps)]  # [B, T] each
        columns = unrolled_rows(answers, self.row_multiple)  # the rows each step runs
        hidden, past_kv, previous = taps, None, columns[0]
        scored_hidden, scored_rows, scored_times, counted = [], [], [], []
        for step, rows_now in enumerate(columns):
            answer = answers[step]
            counted.append(answer.sum())
            if rows_now.numel() == 0:  # nothing scored from here on
                continue
            # 2. One draft step over the rows still needed, attending as the engine would: a
            #    row's hidden state stays in its row, its token and position move on by one.
            kept = torch.searchsorted(previous, rows_now)  # rows_now within the last step's rows
            hidden = hidden if step == 0 else hidden[:, kept]
            ids = shift_left(input_ids, 1 + step)[:, rows_now]  # [B, T_k]
            positions = (rows_now + step).expand(batch, -1)
            mask = unroll_attention_mask(columns[:step + 1])
            out = self.head(hidden, ids, positions, attn_mask=mask, past_kv=past_kv, compute_logits=False)
            # 3. Keep the outputs of answer rows, where the loss is scored: row t of step k
            #    against target row t+1+k.
            rows, times = answer.nonzero(as_tuple=True)  # [M_k] each
            local = torch.full((length,), -1, dtype=torch.int64, device=device)
            local[rows_now] = torch.arange(rows_now.numel(), device=device)
            scored_hidden.append(out.hidden[rows, local[times]])  # [M_k, H]
            scored_rows.append(rows)
            scored_times.append(times + 1 + step)
            # 4. Feed the head's own output back.
            hidden, past_kv, previous = out.hidden, out.past_kv, rows_now
        # 5. The output layer (the widest matmul) once over the scored rows of every step: one
        #    larger matmul and one weight gradient instead of K.
        scored = torch.cat(scored_hidden)  # [M, H], M = sum M_k
        padding = -scored.shape[0] % self.row_multiple
        logits = self.head.compute_logits(F.pad(scored, (0, 0, 0, padding)))[: scored.shape[0]]  # [M, N]
        loss_rows, hit_rows = score_each_row(logits, target, torch.cat(scored_rows), torch.cat(scored_times))
        sizes = [int(rows.numel()) for rows in scored_rows]
        sizes += [0] * (self.steps - len(sizes))  # steps with no row left
        loss_sums = [part.sum() for part in loss_rows.split(sizes)]
        correct = [part.sum() for part in hit_rows.split(sizes)]
        return TTTResult(loss_sums=torch.stack(loss_sums), correct=torch.stack(correct),
                         counted=torch.stack(counted))


def unrolled_rows(answers: list[Tensor], multiple: int = 1) -> list[Tensor]:
    """The time indices [T_k] that step k of the unroll runs, from the scored rows answers[k]
    [B, T] bool: step 0 runs every row (its keys are every later step's context); step k >= 1
    only the rows scored at step k or later (a row's output feeds its own next step and is
    seen by no other row), taken over the whole micro batch. Each step's rows lie within the
    previous step's.

    multiple: each step's count is rounded up to a multiple of it (at most T) with the latest
    rows of the previous step that it does not run; those rows are computed and never scored
    (a row sees only its own keys of steps >= 1, so they change no other row)."""
    length = answers[0].shape[1]
    device = answers[0].device
    columns, later = [], torch.zeros(length, dtype=torch.bool, device=device)
    for answer in reversed(answers[1:]):
        later = later | answer.any(0)  # a new tensor each step
        columns.append(later)
    runs = torch.ones(length, dtype=torch.bool, device=device)  # the previous step's rows
    rows = [torch.arange(length, device=device)]
    for needed in columns[::-1]:
        spare = (runs & ~needed).nonzero().squeeze(1)  # rows the previous step ran, this one need not
        extra = min(-int(needed.sum()) % multiple, spare.numel())
        if extra:
            needed[spare[-extra:]] = True  # the latest of them
        rows.append(needed.nonzero().squeeze(1))
        runs = needed
    return rows


def weighted_loss(loss_sums: Tensor, decay: float) -> Tensor:
    """sum_k decay^k loss_k."""
    weights = decay ** torch.arange(loss_sums.numel(), device=loss_sums.device, dtype=loss_sums.dtype)
    return (weights * loss_sums).sum()
