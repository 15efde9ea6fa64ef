"""Evaluate a drafting method on a prompt set: tau, acceptance per position, and tokens/s of
speculative vs plain decoding, overall and per category, single stream.

Every prompt is decoded twice, plain then speculative, one right after the other (so noise on a
shared machine hits both alike); tokens/s = generated tokens / wall time of the request
(prefill included). Under greedy decoding the two outputs must be identical: the report counts
the prompts where they are, and lists the others.

Usage:
    from eyas.bench.evaluate import EvalConfig, run_eval, format_markdown
    report = run_eval(EvalConfig(draft="eagle3:smollm2-135m", num_prompts=16))
    print(format_markdown(report))
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Callable

import torch

from eyas.errors import EyasError

DATASETS = ("mtbench", "code")


@dataclass
class EvalConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    draft: str = "eagle3:smollm2-135m"  # the shipped head
    tree: str = "auto"  # EAGLE-3 tree: auto, chain:K or DEPTH,TOPK,TOTAL
    num_draft_tokens: int = 8  # most draft tokens per step (methods without their own tree)
    dataset: str = "mtbench"
    num_prompts: int = 80  # MT-Bench has 80 first turns: all of them by default
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    fallback: bool = False  # the never-slower policy; off = measure the method itself
    warmup: int = 1

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise EyasError(f"unknown --dataset '{self.dataset}'; accepted: {', '.join(DATASETS)}")
        if self.draft.partition(":")[0] == "none":
            raise EyasError("--draft none has nothing to evaluate; give a drafting method, "
                            "e.g. eagle3:DIR or ngram")
        if self.num_prompts < 1 or self.max_tokens < 2:
            raise EyasError("--num-prompts must be >= 1 and --max-tokens >= 2")
        if self.num_draft_tokens < 1:
            raise EyasError("--num-draft-tokens must be >= 1")
        if self.temperature < 0:
            raise EyasError("--temperature must be >= 0")


def load_questions(dataset: str, limit: int) -> list[tuple[str, str]]:
    """(category, first-turn question) pairs; MT-Bench interleaves its 8 categories."""
    from eyas.bench.prompts import CODE_PROMPTS, mtbench_categorized_first_turns

    if dataset == "code":
        return [("code", q) for q in CODE_PROMPTS[:limit]]
    return mtbench_categorized_first_turns(limit)


def run_eval(config: EvalConfig, progress: bool = True,
             on_prompt: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    from tqdm import tqdm

    from eyas.engine.generate import generate
    from eyas.engine.sampling import SamplingParams
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.speculative.policy import PolicyConfig
    from eyas.engine.target import load_target
    from eyas.models.tokenizer import chat_prompt_ids

    # 1. Target, proposer, prompts.
    target = load_target(config.model, dtype=config.dtype)
    proposer = build_proposer(config.draft, target, tree=config.tree)
    questions = load_questions(config.dataset, config.num_prompts)
    prompts = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": q}])
               for _, q in questions]
    policy = PolicyConfig(enabled=config.fallback)

    def params(index: int) -> SamplingParams:
        return SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature,
                              seed=config.seed + index if config.temperature > 0 else None)

    def plain(index: int, ids: list[int]):
        return generate(target, ids, params(index))

    def speculative(index: int, ids: list[int]):
        return speculative_generate(target, ids, params(index), proposer, config.num_draft_tokens,
                                    policy=policy)

    # 2. Warm-up (first-call allocations, cost measurements of auto trees), not counted.
    for ids in prompts[: config.warmup]:
        plain(0, ids)
        speculative(0, ids)
    # 3. Each prompt: plain, then speculative.
    rows = []
    for index, ((category, _), ids) in enumerate(tqdm(list(zip(questions, prompts)), desc="eval",
                                                      disable=not progress)):
        started = time.perf_counter()
        base = plain(index, ids)
        plain_s = time.perf_counter() - started
        started = time.perf_counter()
        spec = speculative(index, ids)
        spec_s = time.perf_counter() - started
        stats = spec.stats["speculative"]
        row = {"index": index, "category": category, "prompt_tokens": len(ids),
               "plain_tokens": len(base.token_ids), "plain_seconds": plain_s,
               "spec_tokens": len(spec.token_ids), "spec_seconds": spec_s,
               "identical": base.token_ids == spec.token_ids,
               "steps": stats["verification_steps"], "accepted": stats["accepted_tokens"],
               "drafted": stats["draft_tokens"], "plain_steps": stats["plain_steps"],
               "accepted_per_position": stats["accepted_per_position"],
               "drafted_per_position": stats["drafted_per_position"],
               "tree": stats.get("tree")}
        rows.append(row)
        if on_prompt is not None:
            on_prompt(row)
    return summarize(config, rows, target.precision)


def _group(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps = sum(r["steps"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    plain_rates = [r["plain_tokens"] / r["plain_seconds"] for r in rows]
    spec_rates = [r["spec_tokens"] / r["spec_seconds"] for r in rows]
    plain_total = sum(r["plain_tokens"] for r in rows) / sum(r["plain_seconds"] for r in rows)
    spec_total = sum(r["spec_tokens"] for r in rows) / sum(r["spec_seconds"] for r in rows)
    return {
        "prompts": len(rows),
        "tau": round(1 + accepted / steps, 3) if steps else None,
        "verification_steps": steps,
        "accepted_tokens": accepted,
        "draft_tokens": sum(r["drafted"] for r in rows),
        "plain_median_tokens_per_s": round(statistics.median(plain_rates), 2),
        "spec_median_tokens_per_s": round(statistics.median(spec_rates), 2),
        "plain_total_tokens_per_s": round(plain_total, 2),
        "spec_total_tokens_per_s": round(spec_total, 2),
        "speedup_median": round(statistics.median(s / p for s, p in zip(spec_rates, plain_rates)), 3),
        "speedup_total": round(spec_total / plain_total, 3),
        "identical_outputs": sum(r["identical"] for r in rows),
    }


def summarize(config: EvalConfig, rows: list[dict[str, Any]], precision: str) -> dict[str, Any]:
    """Overall and per-category figures from the per-prompt rows."""
    categories: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        categories.setdefault(row["category"], []).append(row)
    # Acceptance per draft position k (1 = the token after the root): the share of steps that
    # drafted k deep whose accepted path reached depth k.
    depth = max((len(r["drafted_per_position"]) for r in rows), default=0)
    accepted, drafted = [0] * depth, [0] * depth
    for row in rows:
        for k, (a, d) in enumerate(zip(row["accepted_per_position"], row["drafted_per_position"])):
            accepted[k] += a
            drafted[k] += d
    per_position = [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)]
    return {
        "config": asdict(config),
        "precision": precision,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "overall": {**_group(rows), "acceptance_rate_per_position": per_position},
        "per_category": {name: _group(group) for name, group in categories.items()},
        "not_identical": [r["index"] for r in rows if not r["identical"]],
        "prompts": rows,
    }


def format_markdown(report: dict[str, Any]) -> str:
    config, overall = report["config"], report["overall"]
    greedy = config["temperature"] == 0
    lines = [
        f"# eyas eval: {config['draft']} on {config['model']} ({report['precision']})",
        "",
        f"{overall['prompts']} {config['dataset']} prompts, {config['max_tokens']} new tokens max, "
        f"temperature {config['temperature']}, tree {config['tree']}, fallback "
        f"{'on' if config['fallback'] else 'off'}; {report['machine']}, {report['date']}, "
        f"torch {report['torch']}.",
        "",
        "| category | prompts | tau | plain tok/s | speculative tok/s | speedup | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    groups = [*report["per_category"].items(), ("**all**", overall)]
    for name, g in groups:
        tau = f"{g['tau']:.2f}" if g["tau"] is not None else "-"
        same = f"{g['identical_outputs']}/{g['prompts']}" if greedy else "n/a (sampled)"
        lines.append(f"| {name} | {g['prompts']} | {tau} | {g['plain_median_tokens_per_s']:.1f} | "
                     f"{g['spec_median_tokens_per_s']:.1f} | {g['speedup_median']:.2f}x | {same} |")
    rates = ", ".join(f"{r:.2f}" for r in overall["acceptance_rate_per_position"])
    lines += [
        "",
        "tok/s are medians over prompts (prefill included); speedup is the median of the "
        "per-prompt ratios.",
        f"Acceptance rate by draft position (1, 2, ...): {rates}.",
        f"Totals: plain {overall['plain_total_tokens_per_s']:.1f} tok/s, speculative "
        f"{overall['spec_total_tokens_per_s']:.1f} tok/s ({overall['speedup_total']:.2f}x); "
        f"{overall['accepted_tokens']} accepted of {overall['draft_tokens']} drafted tokens over "
        f"{overall['verification_steps']} verification steps.",
    ]
    if greedy and report["not_identical"]:
        lines.append(f"Outputs that differ from plain greedy: prompts {report['not_identical']}.")
    return "\n".join(lines) + "\n"
