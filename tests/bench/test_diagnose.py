"""`eyas eval diagnose`: its statistics on hand-made tensors (exact values), the held-out pick,
and the command end to end on a tiny random target with a random head."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eyas.bench.diagnose.config import DiagnoseConfig
from eyas.bench.diagnose.data import pick
from eyas.bench.diagnose.stats import (accept_length, by_confidence, peakedness, position_coverage,
                                       top1_probability)
from eyas.data.records import Conversation, Message
from eyas.eagle3.vocab import build_draft_vocab
from eyas.errors import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_coverage_counts_positions_whose_greedy_token_is_drafted():
    # top 4 by count (ties: smaller id): 4 (9), 0 (5), 2 (3), 8 (2) -> kept {0, 2, 4, 8}
    counts = torch.tensor([5, 0, 3, 0, 9, 1, 0, 0, 2, 0])
    vocab = build_draft_vocab(counts, 4)
    assert vocab.kept_ids.tolist() == [0, 2, 4, 8]
    greedy = torch.tensor([0, 0, 4, 7, 8, 9, 2, 1])  # inside: 0, 0, 4, 8, 2
    assert position_coverage(greedy, vocab) == 5 / 8
    assert position_coverage(greedy, build_draft_vocab(counts, 10)) == 1.0
    assert position_coverage(torch.tensor([1, 3]), vocab) == 0.0


def test_peakedness_of_hand_made_logits():
    logits = torch.tensor([
        [0.0, 0.0, 0.0, 0.0],  # top-1 0.25
        [math.log(6), 0.0, 0.0, 0.0],  # 6 / 9
        [math.log(2), 0.0, 0.0, 0.0],  # 2 / 5
        [0.0, 0.0, math.log(97), 0.0],  # 97 / 100
    ])
    top1 = top1_probability(logits)
    assert top1.tolist() == pytest.approx([0.25, 6 / 9, 0.4, 0.97], abs=1e-6)
    peak = peakedness(logits)
    assert peak.share_below == 0.5 and peak.positions == 4
    assert peak.mean_top1 == pytest.approx((0.25 + 6 / 9 + 0.4 + 0.97) / 4, abs=1e-6)
    assert peakedness(logits, threshold=0.3).share_below == 0.25


def test_accuracy_by_confidence_and_accept_length():
    top1 = torch.tensor([0.1, 0.2, 0.4, 0.6, 0.9, 1.0])
    hits = torch.tensor([False, True, True, False, True, True])
    buckets = by_confidence(hits, top1)
    assert [b["positions"] for b in buckets] == [2, 1, 1, 2]  # 1.0 falls in the last bucket
    assert [b["accuracy"] for b in buckets] == [0.5, 1.0, 0.0, 1.0]
    assert sum(b["share"] for b in buckets) == pytest.approx(1.0)
    assert accept_length([0.5, 0.4]) == pytest.approx(1 + 0.5 + 0.2)
    assert accept_length([]) == 1.0


def test_held_out_pick_is_fixed_and_ignores_file_order():
    records = [Conversation(f"id{i}", "s", [Message("user", "hi")]) for i in range(20)]
    first = [c.id for c in pick(records, 5)]
    assert [c.id for c in pick(list(reversed(records)), 5)] == first
    assert first == [c.id for c in pick(records, 6)][:5] and len(set(first)) == 5


def test_bad_settings_name_what_is_accepted():
    with pytest.raises(EyasError, match="--target-dtype must be one of"):
        DiagnoseConfig(target_dtype="fp8")
    with pytest.raises(EyasError, match="--skip-counts"):
        DiagnoseConfig(skip_counts=(0,))


@pytest.fixture
def tiny_setup(tmp_path, tiny_model_dir, tiny_target):
    """A random head for the tiny target, a prepared-prompts folder, a tokenized counting corpus."""
    from eyas.eagle3.checkpoint import save_head
    from eyas.eagle3.config import Eagle3Config
    from eyas.eagle3.head import Eagle3Head
    from eyas.features.tokenized import TokenizedSample, write_tokenized

    torch.manual_seed(0)
    vocab_size = tiny_target.config.vocab_size
    config = Eagle3Config.for_target(tiny_target.config, draft_vocab_size=512, target_layer_ids=[0, 1, 2])
    head = Eagle3Head(config)
    counts = torch.zeros(vocab_size)
    counts[torch.randperm(vocab_size)[:3000]] = 1.0
    head.set_vocab(build_draft_vocab(counts, 512))
    save_head(head, tmp_path / "head")
    prompts = tmp_path / "prepared"
    prompts.mkdir()
    for name, count in (("eval", 3), ("train", 4)):
        with open(prompts / f"{name}.jsonl", "w") as handle:
            for i in range(count):
                record = {"id": f"{name}{i}", "source": "t",
                          "conversations": [{"role": "user", "content": f"Tell me about item {i}."}]}
                handle.write(json.dumps(record) + "\n")
    generator = torch.Generator().manual_seed(1)
    samples = [TokenizedSample(f"s{i}", torch.randint(0, vocab_size, (40,), generator=generator),
                               torch.ones(40, dtype=torch.int64)) for i in range(8)]
    write_tokenized(tmp_path / "vocab.jsonl", samples)
    return tmp_path


def test_diagnose_end_to_end_on_a_tiny_target(tiny_setup, tiny_model_dir, capsys):
    from eyas.cli.main import main

    out = tiny_setup / "report"
    code = main(["eval", "diagnose", "--model", str(tiny_model_dir), "--head", str(tiny_setup / "head"),
                 "--prompts", str(tiny_setup / "prepared"), "--held-out-prompts", "2",
                 "--train-prompts", "2", "--max-tokens", "8", "--vocab-sizes", "256,1024",
                 "--vocab-data", str(tiny_setup / "vocab.jsonl"), "--ttt-steps", "3",
                 "--skip-counts", "1", "--mtbench-prompts", "1", "--mtbench-tokens", "4",
                 "--eval-dtype", "float32", "--tree", "chain:2", "--output-dir", str(out),
                 "--no-progress"])
    assert code == 0
    report = json.loads((out / "diagnose.json").read_text())
    assert set(report) >= {"config", "cpu", "splits", "vocabulary", "mtbench", "seconds"}
    assert report["vocabulary"]["sizes"] == {"head": 512, "256": 256, "1024": 1024, "full": 49152}
    assert report["vocabulary"]["answer_tokens"] == 8 * 40
    for name in ("held_out", "training"):
        split = report["splits"][name]
        assert split["prompts"] == 2 and 2 <= split["positions"] <= 2 * 9
        coverage = split["coverage"]
        assert all(0.0 <= value <= 1.0 for value in coverage.values())
        assert coverage["full"] == 1.0 and coverage["256"] <= coverage["1024"] <= coverage["full"]
        peak = split["peakedness"]
        assert 0.0 <= peak["share_top1_below"] <= 1.0 and 0.0 < peak["mean_top1"] <= 1.0
        head = split["head"]
        assert len(head["accuracy_per_step"]) == 3
        assert all(0.0 <= a <= 1.0 for a in head["accuracy_per_step"])
        # the row-by-row step 0 and the training-time test score the same rows alike
        assert head["positions_per_step"][0] == split["positions"]
        assert head["accuracy_per_step"][0] == head["first_step_accuracy"]
        assert head["first_step_accuracy"] <= coverage["head"] + 1e-9
        assert sum(b["positions"] for b in head["first_step_by_target_top1"]) == split["positions"]
        assert 1.0 <= head["accept_length"] <= 4.0
    layerskip = report["splits"]["held_out"]["layerskip"]
    assert len(layerskip) == 1 and layerskip[0]["kept_layers"] == 1
    assert 0.0 <= layerskip[0]["first_step_agreement"] <= 1.0
    mtbench = report["mtbench"]
    assert mtbench["prompts"] == 1 and mtbench["identical_outputs"] == 1
    assert all(0.0 <= r <= 1.0 for r in mtbench["acceptance_rate_per_position"])
    table = capsys.readouterr().out
    assert "| head accuracy per TTT step |" in table and "MT-Bench" in table
    assert (out / "diagnose.md").read_text() == table


def test_an_unknown_head_is_refused_with_the_shipped_names(tmp_path):
    from eyas.bench.diagnose.run import resolve_head_dir

    with pytest.raises(EyasError, match="smollm2-135m"):
        resolve_head_dir(str(tmp_path / "missing"))
