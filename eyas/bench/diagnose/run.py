"""`run_diagnose`: what limits a draft head, measured on one fixed held-out split.

Usage:
    from eyas.bench.diagnose import DiagnoseConfig, run_diagnose, format_table
    report = run_diagnose(DiagnoseConfig(held_out_prompts=24, max_tokens=96, mtbench_prompts=16))
    print(format_table(report))

Steps: the target's greedy answers to held-out and training prompts -> one teacher-forced target
pass each (coverage of every draft vocabulary, peakedness) -> the head unrolled on the target's
features (accuracy per TTT step) -> layer-skip drafts over the same tokens -> MT-Bench
acceptance by position (`eyas eval`).
"""

from __future__ import annotations

import platform
import time
from datetime import datetime, timezone
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eyas.bench.diagnose.config import DiagnoseConfig
from eyas.bench.diagnose.data import SHAREGPT_ANSWERS, pick, prepared_sharegpt, read_conversations, vocabulary_counts
from eyas.bench.diagnose.measure import SplitMeasure, greedy_answers, measure_split
from eyas.bench.diagnose.stats import accept_length, by_confidence, peakedness, position_coverage
from eyas.eagle3.vocab import DraftVocab, build_draft_vocab
from eyas.errors import EyasError


def cpu_name() -> str:
    """The CPU's model name and model number (/proc/cpuinfo), else what platform knows."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        if "model name" in fields:
            return f"{fields['model name']} (model {fields.get('model', '?')})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def resolve_head_dir(spec: str) -> Path:
    from eyas.eagle3.shipped import SHIPPED_HEADS, shipped_head_dir

    if Path(spec).exists():
        return Path(spec)
    shipped = shipped_head_dir(spec)
    if shipped is None:
        raise EyasError(f"--head '{spec}' is neither a head folder nor a shipped head "
                        f"({', '.join(SHIPPED_HEADS)})")
    return shipped


def split_summary(split: SplitMeasure, vocabularies: dict[str, DraftVocab]) -> dict[str, Any]:
    """The figures of one split (all over the same positions)."""
    accuracy = [round(c / n, 4) if n else 0.0
                for c, n in zip(split.head_correct.tolist(), split.head_counted.tolist())]
    peak = peakedness(top1=split.top1)
    head_vocab = vocabularies["head"]
    in_vocab = head_vocab.t2d[split.target_argmax]
    hits = split.head_first_hits
    return {
        "prompts": split.sequences,
        "prompt_tokens": split.prompt_tokens,
        "positions": split.target_argmax.numel(),
        "argmax_equals_generated": round(float(split.generated_match.float().mean()), 4),
        "coverage": {name: round(position_coverage(split.target_argmax, vocab), 4)
                     for name, vocab in vocabularies.items()},
        "peakedness": {"threshold": peak.threshold, "share_top1_below": round(peak.share_below, 4),
                       "mean_top1": round(peak.mean_top1, 4)},
        "head": {
            "first_step_accuracy": round(float(hits.float().mean()), 4),
            "first_step_accuracy_in_vocabulary": round(float(hits[in_vocab].float().mean()), 4)
            if bool(in_vocab.any()) else 0.0,
            "accuracy_per_step": accuracy,
            "positions_per_step": split.head_counted.tolist(),
            "accept_length": round(accept_length(accuracy), 4),
            "first_step_by_target_top1": [
                {**bucket, "share": round(bucket["share"], 4), "accuracy": round(bucket["accuracy"], 4)}
                for bucket in by_confidence(hits, split.top1)],
        },
    }


def mtbench_summary(config: DiagnoseConfig, head_dir: Path, progress: bool) -> dict[str, Any]:
    from eyas.bench.evaluate import EvalConfig, run_eval

    eval_config = EvalConfig(model=config.model, dtype=config.eval_dtype, draft=f"eagle3:{head_dir}",
                             tree=config.tree, num_prompts=config.mtbench_prompts,
                             max_tokens=config.mtbench_tokens, dataset="mtbench")
    report = run_eval(eval_config, progress=progress)
    overall = report["overall"]
    return {"prompts": overall["prompts"], "max_tokens": config.mtbench_tokens,
            "precision": report["precision"], "tree": config.tree, "tau": overall["tau"],
            "acceptance_rate_per_position": overall["acceptance_rate_per_position"],
            "identical_outputs": overall["identical_outputs"],
            "speedup_median": overall["speedup_median"]}


def run_diagnose(config: DiagnoseConfig, progress: bool = False,
                 log=lambda message: None) -> dict[str, Any]:
    from eyas.eagle3 import load_head
    from eyas.engine.target import load_target
    from eyas.features.target_io import describe_target, load_output_weights

    started = time.perf_counter()
    torch.manual_seed(config.seed)
    # 1. Target (in the precision its features were extracted in), head, output layer.
    target = load_target(config.model, dtype=config.target_dtype)
    head_dir = resolve_head_dir(config.head)
    head = load_head(head_dir, embedding=target.model.embed_tokens.weight.float(), dtype=torch.float32)
    if head.config.target_num_hidden_layers not in (None, target.config.num_hidden_layers):
        raise EyasError(f"the head in {head_dir} was trained for a target with "
                        f"{head.config.target_num_hidden_layers} layers; {config.model} has "
                        f"{target.config.num_hidden_layers}")
    _, lm_head_weight = load_output_weights(describe_target(config.model))
    # 2. Prompts: held out (never trained on) and a slice of the training prompts.
    prepared = Path(config.prompts) if config.prompts else prepared_sharegpt(progress)
    held_out = pick(read_conversations(prepared / "eval.jsonl"), config.held_out_prompts)
    training = pick(read_conversations(prepared / "train.jsonl", limit=config.train_pool),
                    config.train_prompts)
    if not held_out:
        raise EyasError(f"{prepared / 'eval.jsonl'} holds no prompts")
    # 3. The draft vocabularies: the head's, the frequency rule's at each size, the full one.
    vocab_size = target.config.vocab_size
    counts, counted = vocabulary_counts(config.vocab_data, target.tokenizer, vocab_size,
                                        prepared if config.vocab_data == SHAREGPT_ANSWERS else None,
                                        config.vocab_pool)
    vocabularies = {"head": head.draft_vocab}
    for size in config.vocab_sizes:
        if size < vocab_size:
            vocabularies[str(size)] = build_draft_vocab(counts, size)
    vocabularies["full"] = build_draft_vocab(counts, vocab_size)
    log(f"draft vocabularies counted on {counted}")
    # 4. Greedy answers, then the teacher-forced measurements of each split.
    splits = {}
    for name, conversations, skips in (("held_out", held_out, config.skip_counts),
                                       ("training", training, ())):
        if not conversations:
            continue
        split_started = time.perf_counter()
        sequences = greedy_answers(target, conversations, config.max_tokens)
        log(f"{name}: {len(sequences)} greedy answers, "
            f"{sum(len(s.answer) for s in sequences)} tokens ({time.perf_counter() - split_started:.0f} s)")
        measured = measure_split(target, head, lm_head_weight, sequences, config.ttt_steps, skips)
        splits[name] = split_summary(measured, vocabularies)
        if skips:
            splits[name]["layerskip"] = [
                {"skip_layers": list(skip), "kept_layers": target.config.num_hidden_layers - len(skip),
                 "first_step_agreement": round(float(hits.float().mean()), 4),
                 "by_target_top1": [{**b, "share": round(b["share"], 4), "accuracy": round(b["accuracy"], 4)}
                                    for b in by_confidence(hits, measured.top1)]}
                for skip, hits in measured.skip_hits.items()]
        log(f"{name}: measured ({time.perf_counter() - split_started:.0f} s)")
    # 5. Acceptance by position on MT-Bench, from `eyas eval`.
    mtbench = mtbench_summary(config, head_dir, progress) if config.mtbench_prompts else None
    return {
        "config": asdict(config),
        "head_dir": str(head_dir),
        "target_precision": target.precision,
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "prompts_from": str(prepared),
        "vocabulary": {"counted_on": counted, "answer_tokens": int(counts.sum()),
                       "distinct_tokens": int((counts > 0).sum()),
                       "sizes": {name: vocab.size for name, vocab in vocabularies.items()}},
        "splits": splits,
        "mtbench": mtbench,
        "seconds": round(time.perf_counter() - started, 1),
    }
