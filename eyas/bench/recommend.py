"""`eyas recommend`: measure which drafting method pays at which concurrency, instead of a rule
of thumb, and recommend one per level with its expected speedup over plain decoding.

The measurements come from `eyas.bench.engine_sweep` (closed loop through the serving engine,
candidates interleaved, median over rounds). The decision is a pure function of them: at each
concurrency the fastest speculative candidate is recommended when it beats plain (`none`) by at
least `min_speedup`, else plain decoding; `rationale` explains the choice in one paragraph from
the same numbers (tau, speedups, the effective cost of a speculative step).

Usage:
    from eyas.bench.recommend import RecommendConfig, run_recommend, format_markdown
    report = run_recommend(RecommendConfig(model="smollm2-135m", concurrency=[1, 4]))
    print(format_markdown(report))

    choices = recommend(measurements, min_speedup=1.05)   # the pure decision, for tests
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from eyas.errors import EyasError

SPECULATION_MODES = ("always", "auto")  # the engine's "never" is what method "none" measures


@dataclass
class RecommendConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    dataset: str = "mtbench"  # mtbench, code, sharegpt, random, jsonl:PATH or repeated
    num_prompts: int = 8
    max_tokens: int = 128
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    methods: list[str] = field(default_factory=lambda: ["none", "ngram", "suffix"])  # --draft specs
    num_draft_tokens: list[int] = field(default_factory=lambda: [4])  # settings tried per method
    speculation: str = "always"  # the engine's policy while measuring: always or auto
    rounds: int = 3
    min_speedup: float = 1.05  # speculation is recommended only when this much faster

    def __post_init__(self) -> None:
        from eyas.bench.datasets import check_dataset_spec
        from eyas.scheduler.proposers import check_spec

        for name in ("num_prompts", "max_tokens", "rounds"):
            if getattr(self, name) < 1:
                raise EyasError(f"{name} must be >= 1, got {getattr(self, name)}")
        levels = self.concurrency
        if not levels or min(levels) < 1 or len(set(levels)) < len(levels):
            raise EyasError(f"concurrency must be distinct levels >= 1 such as 1,2,4,8; got {levels}")
        if not self.num_draft_tokens or min(self.num_draft_tokens) < 1:
            raise EyasError(f"num_draft_tokens must be values >= 1 such as 2,4; "
                            f"got {self.num_draft_tokens}")
        if len(set(self.methods)) < len(self.methods):
            raise EyasError(f"methods must differ; got {self.methods}")
        for method in self.methods:
            check_spec(method)  # names the accepted specs
        if "none" not in self.methods:
            self.methods = ["none", *self.methods]  # the baseline every speedup is relative to
        if self.speculation not in SPECULATION_MODES:
            raise EyasError(f"unknown speculation mode '{self.speculation}'; accepted: "
                            f"{', '.join(SPECULATION_MODES)}")
        if self.dataset != "code":
            try:
                check_dataset_spec(self.dataset)
            except EyasError:
                raise EyasError(f"unknown dataset '{self.dataset}'; accepted: mtbench, code, "
                                "sharegpt, random, jsonl:PATH, repeated") from None
        if self.min_speedup < 1.0:
            raise EyasError(f"min_speedup must be >= 1.0, got {self.min_speedup}")


@dataclass(frozen=True)
class Measurement:
    """One candidate at one concurrency level."""

    concurrency: int
    method: str  # --draft spec; "none" = plain decoding
    num_draft_tokens: int | None  # None for plain
    tokens_per_s: float  # median over rounds
    rounds_tokens_per_s: tuple[float, ...] = ()
    requests: int = 0
    tokens: int = 0  # generated tokens of one round
    verification_steps: int = 0  # summed over rounds
    accepted_tokens: int = 0
    outputs_equal_to_plain: int | None = None  # requests whose output equals plain's

    @property
    def label(self) -> str:
        return self.method if self.method == "none" else f"{self.method} k={self.num_draft_tokens}"

    @property
    def acceptance_length(self) -> float | None:
        steps = self.verification_steps
        return 1 + self.accepted_tokens / steps if steps else None


@dataclass(frozen=True)
class LevelChoice:
    """The recommendation at one concurrency level."""

    concurrency: int
    method: str
    num_draft_tokens: int | None
    tokens_per_s: float
    plain_tokens_per_s: float
    speedup: float  # over plain; 1.0 when plain is recommended
    acceptance_length: float | None
    best_speculative: str | None  # the fastest candidate that drafted, recommended or not
    best_speculative_speedup: float | None

    @property
    def label(self) -> str:
        return self.method if self.method == "none" else f"{self.method} k={self.num_draft_tokens}"

    def serve_flags(self, speculation: str) -> str:
        if self.method == "none":
            return "--draft none"
        return (f"--draft {self.method} --num-draft-tokens {self.num_draft_tokens} "
                f"--speculation {speculation}")


def recommend(measurements: list[Measurement], min_speedup: float = 1.05) -> list[LevelChoice]:
    """Per concurrency level (ascending): the fastest speculative candidate that verified any
    draft, if it reaches `min_speedup` times plain's tokens/s; else plain. (A candidate that
    never drafted decoded plainly: its difference from plain is noise.)"""
    choices = []
    for level in sorted({m.concurrency for m in measurements}):
        rows = [m for m in measurements if m.concurrency == level]
        plain = next((m for m in rows if m.method == "none"), None)
        if plain is None or plain.tokens_per_s <= 0:
            raise EyasError(f"no plain ('none') measurement at concurrency {level}")
        drafted = [m for m in rows if m.method != "none" and m.verification_steps > 0]
        best = max(drafted, key=lambda m: m.tokens_per_s, default=None)
        best_speedup = best.tokens_per_s / plain.tokens_per_s if best else None
        chosen = best if best_speedup is not None and best_speedup >= min_speedup else plain
        choices.append(LevelChoice(
            level, chosen.method, chosen.num_draft_tokens, chosen.tokens_per_s, plain.tokens_per_s,
            chosen.tokens_per_s / plain.tokens_per_s, chosen.acceptance_length,
            best.label if best else None, best_speedup))
    return choices


def _levels(levels: list[int]) -> str:
    return ", ".join(map(str, levels))


def _where_it_pays(levels: list[int], paying: list[int]) -> str:
    if paying == levels:
        return "speculation pays at every measured concurrency"
    if not paying:
        return "speculation does not pay at any measured concurrency"
    if paying == levels[: len(paying)]:
        return f"speculation pays up to concurrency {paying[-1]}, not beyond"
    if paying == levels[-len(paying):]:
        return f"speculation pays from concurrency {paying[0]} on, not below"
    losing = [level for level in levels if level not in paying]
    return (f"speculation pays at concurrency {', '.join(map(str, paying))}, "
            f"not at {', '.join(map(str, losing))}")


def rationale(measurements: list[Measurement], choices: list[LevelChoice], min_speedup: float) -> str:
    """One paragraph from the numbers: per method its tau, where it pays, what a step costs."""
    plain = {m.concurrency: m.tokens_per_s for m in measurements if m.method == "none"}
    levels = sorted(plain)
    sentences = []
    for method in dict.fromkeys(m.method for m in measurements if m.method != "none"):
        rows = [m for m in measurements if m.method == method]
        steps = sum(m.verification_steps for m in rows)
        if not steps:
            sentences.append(f"{method}: no draft was verified on this workload (nothing to "
                             "propose), so it decoded plainly and is not recommended.")
            continue
        tau = 1 + sum(m.accepted_tokens for m in rows) / steps
        best = {level: max((m for m in rows if m.concurrency == level), key=lambda m: m.tokens_per_s)
                for level in levels}
        speedups = {level: best[level].tokens_per_s / plain[level] for level in levels}
        paying = [level for level in levels if speedups[level] >= min_speedup]
        sentence = (f"{method}: tau {tau:.2f} on this workload; {_where_it_pays(levels, paying)} ("
                    + ", ".join(f"{speedups[level]:.2f}x at {level}" for level in levels) + ")")
        first, last = levels[0], levels[-1]
        cost = {level: best[level].acceptance_length / speedups[level] for level in (first, last)
                if best[level].acceptance_length and speedups[level] > 0}
        if first in cost:
            sentence += (f"; a speculative step takes {cost[first]:.2f}x the time of a plain step "
                         f"at concurrency {first}")
            if last != first and last in cost:
                sentence += f" and {cost[last]:.2f}x at {last}"
            sentence += " (tau / speedup)"
        sentences.append(sentence + ".")
    groups: list[tuple[str, list[int], list[float]]] = []
    for choice in choices:
        if groups and groups[-1][0] == choice.label:
            groups[-1][1].append(choice.concurrency)
            groups[-1][2].append(choice.speedup)
        else:
            groups.append((choice.label, [choice.concurrency], [choice.speedup]))
    parts = [(f"plain decoding at concurrency {_levels(group)}" if label == "none" else
              f"{label} at concurrency {_levels(group)} ("
              + ", ".join(f"{s:.2f}x" for s in speedups) + ")")
             for label, group, speedups in groups]
    sentences.append(f"Recommended: {'; '.join(parts)}. Speculation is recommended only where it "
                     f"reaches {min_speedup:.2f}x plain.")
    return " ".join(sentences)


def build_report(config: RecommendConfig, measurements: list[Measurement],
                 precision: str) -> dict[str, Any]:
    import torch

    from eyas import __version__

    choices = recommend(measurements, config.min_speedup)
    return {
        "config": asdict(config),
        "precision": precision,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "eyas_version": __version__,
        "measurements": [{**asdict(m), "label": m.label, "acceptance_length": m.acceptance_length}
                         for m in measurements],
        "recommendations": [{**asdict(c), "label": c.label,
                             "serve_flags": c.serve_flags(config.speculation)} for c in choices],
        "rationale": rationale(measurements, choices, config.min_speedup),
    }


def format_markdown(report: dict[str, Any]) -> str:
    config = report["config"]
    labels = list(dict.fromkeys(m["label"] for m in report["measurements"]))
    by_key = {(m["concurrency"], m["label"]): m for m in report["measurements"]}
    lines = [f"eyas recommend: {config['model']} ({report['precision']}), {config['num_prompts']} "
             f"{config['dataset']} prompts, {config['max_tokens']} new tokens max, greedy, "
             f"speculation {config['speculation']}, median of {config['rounds']} "
             f"round{'s' if config['rounds'] > 1 else ''}; "
             f"{report['machine']}, {report['date']}", "",
             "| concurrency | " + " | ".join(f"{label} tok/s" for label in labels)
             + " | recommended | speedup | settings |",
             "|---" * (len(labels) + 4) + "|"]
    for choice in report["recommendations"]:
        cells = []
        for label in labels:
            m = by_key[(choice["concurrency"], label)]
            tau = f" (tau {m['acceptance_length']:.2f})" if m["acceptance_length"] else ""
            cells.append(f"{m['tokens_per_s']:.1f}{tau}")
        lines.append(f"| {choice['concurrency']} | " + " | ".join(cells)
                     + f" | {choice['label']} | {choice['speedup']:.2f}x | `{choice['serve_flags']}` |")
    return "\n".join(lines + ["", report["rationale"]])


def run_recommend(config: RecommendConfig) -> dict[str, Any]:
    """Load the target, sweep every candidate at every level, decide; the report as a dict."""
    from eyas.bench.engine_sweep import Candidate, sweep, workload_prompts
    from eyas.engine.target import load_target

    target = load_target(config.model, dtype=config.dtype)
    prompts = workload_prompts(config.dataset, config.num_prompts, target.tokenizer)
    candidates = [Candidate("none")] + [Candidate(method, k) for method in config.methods
                                        if method != "none" for k in config.num_draft_tokens]
    measurements = sweep(target, prompts, candidates, config.concurrency, config.max_tokens,
                         config.rounds, config.speculation)
    return build_report(config, measurements, target.precision)
