"""Training-time test: masks, positions and inputs per step, loss masking, and parity of the
train-time unroll with serve-time drafting through an external KV state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eyas.eagle3.config import Eagle3Config
from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.vocab import build_draft_vocab
from eyas.training.ttt import (
    TargetDistribution,
    TargetOutputLayer,
    TrainingTimeTest,
    scored_target_rows,
    shift_left,
    target_distribution,
    ttt_attention_mask,
    unroll_attention_mask,
    unrolled_rows,
    weighted_loss,
)

V, N, H = 40, 16, 16


def tiny_head(seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    config = Eagle3Config(hidden_size=H, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=8, vocab_size=V, draft_vocab_size=N, target_hidden_size=H,
                          target_layer_ids=[2, 4, 5], target_num_hidden_layers=8)
    head = Eagle3Head(config)
    head.set_embedding(torch.randn(V, H))
    head.set_vocab(build_draft_vocab(torch.arange(V).flip(0), N))  # keeps ids 0..15
    return head


def random_target(batch: int, length: int, seed: int = 1) -> TargetDistribution:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(batch, length, N, generator=generator), -1)
    in_draft = torch.rand(batch, length, generator=generator) > 0.3
    return TargetDistribution(probs=probs, in_draft=in_draft, argmax_draft=probs.argmax(-1))


def test_mask_by_hand() -> None:
    expected = torch.tensor([
        # step-0 keys (causal) | step-1 keys (diagonal) | step-2 keys (diagonal)
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ttt_attention_mask(3, 2), expected)
    assert torch.equal(ttt_attention_mask(3, 0), expected[:, :3])


def test_shift_left() -> None:
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 1).tolist() == [[2, 3, 4, 0]]
    assert shift_left(x, 2).tolist() == [[3, 4, 0, 0]]


def test_inputs_positions_and_masks_of_each_step() -> None:
    head = tiny_head()
    calls = []

    def record(module, args, kwargs, output):
        calls.append({"width": args[0].shape[-1], "hidden": args[0], "ids": args[1].clone(),
                      "positions": args[2].clone(), "mask": kwargs["attn_mask"],
                      "past": 0 if kwargs["past_kv"] is None else kwargs["past_kv"][0].shape[2],
                      "output": output.hidden})

    head.register_forward_hook(record, with_kwargs=True)
    ids = torch.tensor([[11, 12, 13, 14, 15, 16]])
    # every token an answer: row t is scored at step k while t + 2 + k < 6, so steps 0, 1, 2
    # run rows 0..5 (all: the step-0 keys), 0..2 and 0..1
    TrainingTimeTest(head, steps=3)(torch.randn(1, 6, 3 * H), ids, torch.ones(1, 6, dtype=torch.int64),
                                    random_target(1, 6))
    assert [c["width"] for c in calls] == [3 * H, H, H]  # fused taps, then the head's own output
    assert torch.equal(calls[1]["hidden"], calls[0]["output"][:, :3])
    assert torch.equal(calls[2]["hidden"], calls[1]["output"][:, :2])
    assert [c["ids"].tolist() for c in calls] == [[[12, 13, 14, 15, 16, 0]], [[13, 14, 15]], [[14, 15]]]
    assert [c["positions"].tolist() for c in calls] == [[[0, 1, 2, 3, 4, 5]], [[1, 2, 3]], [[2, 3]]]
    assert [c["past"] for c in calls] == [0, 6, 9]
    assert torch.equal(calls[0]["mask"], ttt_attention_mask(6, 0))
    assert torch.equal(calls[1]["mask"], ttt_attention_mask(6, 1)[:3, :9])
    expected = torch.tensor([
        # step-0 keys (causal) | step-1 keys, rows 0..2 | step-2 keys, rows 0..1
        [1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(calls[2]["mask"], expected)


def test_unrolled_rows_skip_rows_scored_at_no_later_step() -> None:
    # two samples: answers from token 5 on in the first, tokens 3 and 4 in the second
    loss_mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1],
                              [0, 0, 0, 1, 1, 0, 0, 0, 0, 0]])
    answers = [shift_left(loss_mask, 2 + step).bool() for step in range(3)]
    # step k scores rows t with loss_mask[t + 2 + k]: first sample t = 3 - k..7 - k, second
    # 1 - k..2 - k; step k >= 1 runs the rows scored at steps k..2
    columns = unrolled_rows(answers)
    assert [c.tolist() for c in columns] == [list(range(10)), [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5]]
    one = unrolled_rows([a[:1] for a in answers])  # the first sample alone
    assert [c.tolist() for c in one] == [list(range(10)), [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5]]


def test_unroll_attention_mask_of_a_subset_by_hand() -> None:
    columns = [torch.arange(4), torch.tensor([1, 3]), torch.tensor([3])]
    expected = torch.tensor([[1, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)  # row 3: causal, its own keys
    assert torch.equal(unroll_attention_mask(columns), expected)
    assert torch.equal(unroll_attention_mask(columns[:2]), torch.tensor([[1, 1, 0, 0, 1, 0],
                                                                        [1, 1, 1, 1, 0, 1]], dtype=torch.bool))


def test_loss_counts_answer_rows_in_the_draft_vocab_only() -> None:
    head = tiny_head()
    taps = torch.randn(1, 6, 3 * H)
    ids = torch.randint(0, V, (1, 6))
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 0]])  # rows t with loss_mask[t + 2]: t = 1, 2
    target = random_target(1, 6)
    target.in_draft[0, 2] = True  # row 1 reads target row 2: drafted
    target.in_draft[0, 3] = False  # row 2 reads target row 3: outside the draft vocabulary
    unroll = TrainingTimeTest(head, steps=1)
    result = unroll(taps, ids, loss_mask, target)
    # by hand: only row 1 counts at step 0
    out = head(taps, shift_left(ids), torch.arange(6)[None], attn_mask=ttt_attention_mask(6, 0))
    expected = -(target.probs[0, 2] * F.log_softmax(out.logits[0, 1], -1)).sum()
    assert result.loss_sums[0].item() == pytest.approx(expected.item(), rel=1e-6)
    assert result.counted.tolist() == [2]  # both answer rows are counted for accuracy
    # target rows outside the weighted ones do not matter at all
    changed = TargetDistribution(target.probs.clone(), target.in_draft, target.argmax_draft)
    changed.probs[0, [0, 1, 3, 4, 5]] = torch.softmax(torch.randn(5, N), -1)
    assert torch.equal(unroll(taps, ids, loss_mask, changed).loss_sums, result.loss_sums)


def test_unrolled_rows_rounded_up_with_the_latest_spare_rows() -> None:
    """With a multiple, each step runs its needed rows plus the latest rows of the previous step
    that it does not need, up to a multiple of it (at most the previous step's rows)."""
    loss_mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0],
                              [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    answers = [shift_left(loss_mask, 2 + step).bool() for step in range(4)]
    needed = unrolled_rows(answers)
    assert [c.tolist() for c in needed][1:] == [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4]]
    padded = unrolled_rows(answers, multiple=4)
    assert [c.tolist() for c in padded] == [list(range(12)), [0, 1, 2, 3, 4, 5, 6, 11],
                                            [0, 1, 2, 3, 4, 5, 6, 11], [0, 1, 2, 3, 4, 5, 6, 11]]
    for earlier, later, rows in zip(padded, padded[1:], needed[1:]):
        assert set(rows.tolist()) <= set(later.tolist()) <= set(earlier.tolist())
    wide = unrolled_rows(answers, multiple=64)  # never more rows than the step before
    assert all(c.tolist() == list(range(12)) for c in wide)


def test_padded_rows_change_no_scored_row() -> None:
    """Rounding the rows of each step and of the output layer up (`row_multiple`, for backends
    that build a kernel per shape) adds rows that nobody scores: the same losses, hits and
    gradients."""
    head, steps = tiny_head(5), 4
    generator = torch.Generator().manual_seed(11)
    taps = torch.randn(2, 13, 3 * H, generator=generator)
    input_ids = torch.randint(0, V, (2, 13), generator=generator)
    loss_mask = (torch.rand(2, 13, generator=generator) > 0.4).long()
    loss_mask[:, -3:] = 0
    target = random_target(2, 13, seed=6)
    results, grads = [], []
    for multiple in (1, 8):
        head.zero_grad()
        result = TrainingTimeTest(head, steps, row_multiple=multiple)(taps, input_ids, loss_mask, target)
        weighted_loss(result.loss_sums, 0.8).backward()
        results.append(result)
        grads.append({name: p.grad.clone() for name, p in head.named_parameters() if p.grad is not None})
    plain, padded = results
    assert torch.allclose(plain.loss_sums, padded.loss_sums, rtol=1e-5, atol=1e-6)
    assert plain.correct.tolist() == padded.correct.tolist()
    assert plain.counted.tolist() == padded.counted.tolist() and float(plain.loss_sums.detach().sum()) > 0
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6), name


def reference_unroll(head: Eagle3Head, steps: int, taps, input_ids, loss_mask, target):
    """The unroll with the output layer applied step by step (plain reference)."""
    length = input_ids.shape[1]
    positions = torch.arange(length).expand_as(input_ids)
    ids, answer = shift_left(input_ids), shift_left(loss_mask, 2).bool()
    hidden, past_kv, losses, hits = taps, None, [], []
    for step in range(steps):
        out = head(hidden, ids, positions + step, attn_mask=ttt_attention_mask(length, step), past_kv=past_kv)
        rows, times = answer.nonzero(as_tuple=True)
        logits = out.logits[rows, times]
        drafted = target.in_draft[rows, times + 1 + step]
        log_q = F.log_softmax(logits, -1)
        losses.append(-(drafted.float() * (target.probs[rows, times + 1 + step] * log_q).sum(-1)).sum())
        hits.append(((logits.argmax(-1) == target.argmax_draft[rows, times + 1 + step]) & drafted).sum())
        hidden, past_kv = out.hidden, out.past_kv
        ids, answer = shift_left(ids), shift_left(answer)
    return torch.stack(losses), torch.stack(hits)


def test_one_output_layer_call_for_every_step_equals_the_step_by_step_reference() -> None:
    """The unroll runs the output layer once over the scored rows of all steps: the loss per step,
    the hits and the gradients are those of applying it step by step."""
    head, steps = tiny_head(3), 4
    generator = torch.Generator().manual_seed(9)
    taps = torch.randn(2, 10, 3 * H, generator=generator)
    input_ids = torch.randint(0, V, (2, 10), generator=generator)
    loss_mask = (torch.rand(2, 10, generator=generator) > 0.3).long()
    target = random_target(2, 10, seed=4)
    result = TrainingTimeTest(head, steps)(taps, input_ids, loss_mask, target)
    weighted_loss(result.loss_sums, 0.8).backward()
    grads = {name: p.grad.clone() for name, p in head.named_parameters() if p.grad is not None}
    head.zero_grad()
    losses, hits = reference_unroll(head, steps, taps, input_ids, loss_mask, target)
    weighted_loss(losses, 0.8).backward()
    assert torch.allclose(result.loss_sums, losses, rtol=1e-5, atol=1e-6)
    assert result.correct.tolist() == hits.tolist() and float(losses.detach().sum()) > 0
    assert set(grads) == {name for name, p in head.named_parameters() if p.grad is not None}
    for name, p in head.named_parameters():
        if p.grad is not None:
            assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6), name


def test_weighted_loss_decays() -> None:
    assert weighted_loss(torch.tensor([1.0, 1.0, 1.0]), 0.8).item() == pytest.approx(1 + 0.8 + 0.64)


def test_target_distribution_restricts_to_the_draft_vocab() -> None:
    vocab = build_draft_vocab(torch.tensor([0, 9, 0, 9, 9, 0]), 3)  # kept ids 1, 3, 4
    lm_head = torch.zeros(6, 2)
    lm_head[1] = torch.tensor([1.0, 0.0])
    lm_head[3] = torch.tensor([0.0, 1.0])
    lm_head[5] = torch.tensor([0.6, 0.6])  # the argmax when both coordinates are high: not drafted
    hidden = torch.tensor([[[3.0, 0.0], [0.0, 3.0], [3.0, 3.0]]])
    out = target_distribution(hidden, lm_head, vocab)
    assert out.in_draft.tolist() == [[True, True, False]]
    assert out.argmax_draft.tolist() == [[0, 1, 0]]  # target 1 -> draft 0, target 3 -> draft 1
    expected = torch.softmax(torch.tensor([3.0, 0.0, 0.0]), -1)  # logits of kept ids 1, 3, 4
    assert torch.allclose(out.probs[0, 0], expected)


def test_target_argmax_ties_and_cached_labels() -> None:
    """The argmax over the whole vocabulary from the split output layer takes the lowest target
    id on ties, as one argmax over all V logits does; given `labels`, only the kept rows run."""
    vocab = build_draft_vocab(torch.tensor([0, 9, 0, 9, 9, 0]), 3)  # kept ids 1, 3, 4
    lm_head = torch.zeros(6, 2)
    lm_head[0] = torch.tensor([1.0, 0.0])  # ties with kept id 1 and comes first: not drafted
    lm_head[1] = torch.tensor([1.0, 0.0])
    lm_head[3] = torch.tensor([0.0, 1.0])
    lm_head[5] = torch.tensor([0.0, 1.0])  # ties with kept id 3 and comes after it: drafted
    hidden = torch.tensor([[[3.0, 0.0], [0.0, 3.0], [-1.0, -1.0]]])
    out = target_distribution(hidden, lm_head, vocab)
    logits = hidden[0] @ lm_head.T
    assert logits.argmax(-1).tolist() == [0, 3, 2]  # the reference: one argmax over V
    assert out.in_draft.tolist() == [[False, True, False]]
    assert out.argmax_draft.tolist() == [[0, 1, 0]]
    layer = TargetOutputLayer(lm_head, vocab)
    layer.other = torch.full_like(layer.other, float("nan"))  # never read with labels given
    again = target_distribution(hidden, layer, vocab, labels=out.labels)
    assert torch.equal(again.probs, out.probs) and torch.equal(again.in_draft, out.in_draft)
    assert torch.equal(again.argmax_draft, out.argmax_draft)


def test_scored_target_rows_by_hand() -> None:
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0, 0, 1]])
    # answer rows t (loss_mask[t + 2] == 1): 1, 2, 7; steps k < 2 read rows t + 1 and t + 2
    assert scored_target_rows(loss_mask, 2).int().tolist() == [[0, 0, 1, 1, 1, 0, 0, 0, 1, 1]]
    assert scored_target_rows(loss_mask, 1).int().tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 1, 0]]


def test_unroll_on_the_scored_rows_only_equals_the_full_distribution() -> None:
    """The trainer computes the target's distribution on scored_target_rows only: the loss,
    hits and gradients are those of the distribution on every row."""
    head, steps = tiny_head(), 3
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, V, (2, 12), generator=generator)
    loss_mask = (torch.rand(2, 12, generator=generator) > 0.4).long()
    loss_mask[:, :3] = 0  # a prompt: rows never read
    hidden = torch.randn(2, 12, H, generator=generator)
    lm_head = torch.randn(V, H, generator=generator)
    vocab = head.draft_vocab
    rows = scored_target_rows(loss_mask, steps)
    assert 0 < int(rows.sum()) < rows.numel()
    full = target_distribution(hidden, lm_head, vocab)
    partial = target_distribution(hidden, lm_head, vocab, rows=rows)
    assert torch.equal(partial.probs[rows], full.probs[rows]) and float(partial.probs[~rows].abs().sum()) == 0.0
    taps = torch.randn(2, 12, 3 * H, generator=generator)
    results, grads = [], []
    for target in (full, partial):
        head.zero_grad()
        result = TrainingTimeTest(head, steps)(taps, input_ids, loss_mask, target)
        weighted_loss(result.loss_sums, 0.8).backward()
        results.append(result)
        grads.append(head.fc.weight.grad.clone())
    assert torch.equal(results[0].loss_sums, results[1].loss_sums)
    assert torch.equal(results[0].correct, results[1].correct)
    assert torch.equal(grads[0], grads[1])


def test_train_time_unroll_equals_serve_time_drafting() -> None:
    """Step k of the unroll at row t == the engine drafting k tokens after position t."""
    head = tiny_head().eval()
    length, steps = 10, 3  # row 4 is scored at every step (4 + 2 + 2 < 10): the unroll runs it
    taps, ids = torch.randn(1, length, 3 * H), torch.randint(0, V, (1, length))
    logits = []
    head.register_forward_hook(lambda module, args, output: logits.append(module.compute_logits(output.hidden)))
    TrainingTimeTest(head, steps)(taps, ids, torch.ones(1, length, dtype=torch.int64),
                                  random_target(1, length))
    row = 4
    with torch.no_grad():
        # prefill over the context: rows 0..row, feature of t with token t + 1, position t
        prefix = head(taps[:, :row + 1], ids[:, 1:row + 2], torch.arange(row + 1)[None])
        assert torch.allclose(prefix.logits[0, row], logits[0][0, row], atol=1e-5)
        hidden, past = prefix.hidden[:, -1:], prefix.past_kv
        for step in range(1, steps):
            token = ids[:, row + 1 + step:row + 2 + step]
            out = head(hidden, token, torch.tensor([[row + step]]), past_kv=past)
            assert torch.allclose(out.logits[0, 0], logits[step][0, row], atol=1e-5)
            hidden, past = out.hidden, out.past_kv
