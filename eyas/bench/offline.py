"""Single-stream offline benchmark: eyas beside its peers, same prompts, one run.

Every system gets the same chat-templated prompt ids, greedy decoding and the same max_tokens;
prompts are run interleaved (prompt 1 on every system, then prompt 2, ...) so that noise on a
shared machine hits all systems alike. tokens/s = generated tokens / wall time of the request
(prefill included), reported as the median over prompts and as total tokens / total time.

Usage:
    from eyas.bench.offline import OfflineConfig, run_offline
    report = run_offline(OfflineConfig(model="smollm2-135m", systems=["eyas:int4", "hf"]))
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from eyas.bench.peers import Runner, hf_runner, llama_cpp_runner
from eyas.bench.prompts import load_prompt_set
from eyas.errors import EyasError

SYSTEM_KINDS = ("eyas", "hf", "hf-lookup", "hf-assisted", "llama.cpp")
ACCEPTED_SYSTEMS = "eyas[:PRECISION[+DRAFT]], hf, hf-lookup, hf-assisted:DRAFT_MODEL, llama.cpp"


@dataclass
class OfflineConfig:
    model: str = "smollm2-135m"
    dataset: str = "mtbench"
    num_prompts: int = 8
    max_tokens: int = 128
    systems: list[str] = field(default_factory=lambda: ["eyas:auto", "eyas:float32", "hf"])
    warmup: int = 1
    num_draft_tokens: int = 4
    tree: str = "auto"  # EAGLE-3 / Medusa rows without a '~TREE' suffix of their own

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_tokens < 1:
            raise EyasError("num_prompts and max_tokens must be >= 1")
        for system in self.systems:
            kind, _, option = system.partition(":")
            if kind not in SYSTEM_KINDS:
                raise EyasError(f"unknown system '{system}'; accepted: {ACCEPTED_SYSTEMS}")
            if kind == "eyas" and "~" in option:
                _check_tree(option.rpartition("~")[2], system)
            if kind == "hf-assisted" and not option:
                raise EyasError("hf-assisted needs its draft model: hf-assisted:ALIAS_OR_PATH "
                                "(same tokenizer as the target, e.g. hf-assisted:smollm2-135m)")
        _check_tree(self.tree, "--tree")


def _check_tree(tree: str, where: str) -> None:
    """A clear error for a bad draft tree before any model loads."""
    from eyas.engine.speculative.proposers.eagle3 import TreeShape

    if tree != "auto":
        try:
            TreeShape.parse(tree)
        except EyasError as error:
            raise EyasError(f"{where}: {error}; or auto") from None


_TARGETS: dict[tuple[str, str], Any] = {}  # one loaded target per (model, precision) per run


def eyas_runner(model: str, option: str, max_tokens: int, num_draft_tokens: int,
                spec_stats: list[dict], tree: str = "auto") -> tuple[Runner, str]:
    """option = PRECISION[+DRAFT[~TREE]], e.g. 'auto', 'float32+ngram', 'int4+ngram:3,1,3',
    'int4+eagle3:smollm2-135m~chain:1' (TREE: that row's draft tree, else `tree`)."""
    from eyas.engine.generate import SamplingParams, generate
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.target import load_target

    precision, _, draft = option.partition("+")
    draft, _, own_tree = draft.partition("~")
    tree = own_tree or tree
    key = (model, precision or "auto")
    if key not in _TARGETS:
        _TARGETS[key] = load_target(model, dtype=precision or "auto")
    target = _TARGETS[key]
    params = SamplingParams(max_tokens=max_tokens)
    proposer = build_proposer(draft or "none", target, tree=tree)
    if proposer is None:
        return (lambda ids: generate(target, ids, params).token_ids), f"eyas plain ({target.precision})"

    def run(ids: list[int]) -> list[int]:
        result = speculative_generate(target, ids, params, proposer, num_draft_tokens)
        spec_stats.append(result.stats["speculative"])
        return result.token_ids

    run.proposer = proposer  # type: ignore[attr-defined]
    shown = draft if tree == "auto" else f"{draft} tree {tree}"
    return run, f"eyas {shown} k={num_draft_tokens} ({target.precision})"


def repeated_prompt_ids(config: OfflineConfig, tokenizer) -> list[list[int]]:
    """The `repeated` set (eyas.bench.repeated) as prompt ids; the history of its re-sent
    conversations holds the target's own greedy answer (plain decoding, not timed)."""
    from eyas.bench.repeated import repeated_prompts
    from eyas.engine.generate import SamplingParams, generate
    from eyas.engine.target import load_target
    from eyas.models.tokenizer import chat_prompt_ids

    key = (config.model, "auto")
    if key not in _TARGETS:
        _TARGETS[key] = load_target(config.model, dtype="auto")
    target = _TARGETS[key]

    def answer(messages) -> str:
        ids = chat_prompt_ids(tokenizer, list(messages))
        output = generate(target, ids, SamplingParams(max_tokens=config.max_tokens)).token_ids
        return tokenizer.decode(output, skip_special_tokens=True)

    conversations = repeated_prompts(config.num_prompts, answer)[: config.num_prompts]
    return [chat_prompt_ids(tokenizer, list(messages)) for messages in conversations]


def build_runners(config: OfflineConfig, folder: str) -> list[tuple[Runner, str, list[dict]]]:
    runners = []
    for system in config.systems:
        kind, _, option = system.partition(":")
        stats: list[dict] = []
        if kind == "eyas":
            run, name = eyas_runner(config.model, option or "auto", config.max_tokens,
                                    config.num_draft_tokens, stats, config.tree)
            runners.append((run, name, stats))
        elif kind in ("hf", "hf-lookup", "hf-assisted"):
            runners.append((*hf_runner(folder, config.max_tokens, lookup=kind == "hf-lookup",
                                       assistant=option if kind == "hf-assisted" else None), stats))
        elif kind == "llama.cpp":
            runner = llama_cpp_runner(config.model, config.max_tokens)
            if runner is None:
                print("[eyas] llama.cpp skipped: llama-cpp-python is not installed "
                      "(or the model is neither an embedded GGUF alias nor a .gguf file)")
            else:
                runners.append((*runner, stats))
    return runners


def run_offline(config: OfflineConfig, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    from eyas.models.registry import resolve_model
    from eyas.models.tokenizer import chat_prompt_ids, load_tokenizer

    folder = str(resolve_model(config.model))
    tokenizer = load_tokenizer(folder)
    if config.dataset == "repeated":
        prompts = repeated_prompt_ids(config, tokenizer)
    else:
        questions = load_prompt_set(config.dataset, config.num_prompts)
        prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    runners = build_runners(config, folder)
    for run, _, stats in runners:  # warm-up: first-call allocations and kernel selection
        for ids in prompts[: config.warmup]:
            run(ids)
        stats.clear()
        forget = getattr(getattr(run, "proposer", None), "forget", None)
        if forget is not None:  # suffix decoding: the warm-up's output must not help
            forget()
    per_system: list[dict[str, Any]] = [{"system": name, "tokens": [], "seconds": [], "outputs": []}
                                        for _, name, _ in runners]
    for ids in tqdm(prompts, desc="prompts", disable=not progress):
        for (run, _, _), record in zip(runners, per_system):
            started = time.perf_counter()
            output = run(ids)
            record["seconds"].append(time.perf_counter() - started)
            record["tokens"].append(len(output))
            record["outputs"].append(output)
    reference = per_system[-1] if runners else None
    for (_, _, stats), record in zip(runners, per_system):
        if stats:
            steps = sum(s["verification_steps"] for s in stats)
            accepted = sum(s["accepted_tokens"] for s in stats)
            record["acceptance_length"] = 1 + accepted / steps if steps else None
            record["plain_steps"] = sum(s["plain_steps"] for s in stats)
            record["fallbacks"] = sum(s["fallbacks"] for s in stats)
    for record in per_system:
        rates = [t / s for t, s in zip(record["tokens"], record["seconds"])]
        record["median_tokens_per_s"] = statistics.median(rates)
        record["total_tokens_per_s"] = sum(record["tokens"]) / sum(record["seconds"])
    baseline = next((r for r in per_system if r["system"].startswith("transformers generate (")), None)
    for record in per_system:
        if baseline:
            record["ratio_vs_transformers"] = (record["median_tokens_per_s"]
                                               / baseline["median_tokens_per_s"])
        if reference is not None:
            same = sum(o == ref for o, ref in zip(record["outputs"], reference["outputs"]))
            record["identical_outputs_to_last"] = same
    return {
        "config": config.__dict__,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "results": [{k: v for k, v in r.items() if k != "outputs"} for r in per_system],
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"offline single-stream benchmark: {report['config']['model']}, "
        f"{report['config']['num_prompts']} {report['config']['dataset']} prompts, "
        f"{report['config']['max_tokens']} new tokens max, greedy; {report['machine']}, "
        f"{report['date']}",
        "",
        "| system | median tok/s | total tok/s | vs transformers | tau | tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        ratio = f"{r['ratio_vs_transformers']:.2f}x" if "ratio_vs_transformers" in r else "-"
        tau = f"{r['acceptance_length']:.2f}" if r.get("acceptance_length") else "-"
        lines.append(f"| {r['system']} | {r['median_tokens_per_s']:.1f} | "
                     f"{r['total_tokens_per_s']:.1f} | {ratio} | {tau} | {sum(r['tokens'])} |")
    return "\n".join(lines)
