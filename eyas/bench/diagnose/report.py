"""The diagnosis report as a markdown table (the JSON report holds every figure)."""

from __future__ import annotations

from typing import Any


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _row(label: str, splits: dict[str, Any], value) -> str:
    cells = [value(split) if split is not None else "-"
             for split in (splits.get("held_out"), splits.get("training"))]
    return f"| {label} | {cells[0]} | {cells[1]} |"


def format_table(report: dict[str, Any]) -> str:
    config, splits = report["config"], report["splits"]
    sizes = report["vocabulary"]["sizes"]
    held = splits.get("held_out", {})
    lines = [
        f"# eyas eval diagnose: {config['head']} on {config['model']} ({report['target_precision']} passes)",
        "",
        f"{held.get('prompts', 0)} held-out prompts (eval split) and "
        f"{splits.get('training', {}).get('prompts', 0)} training prompts, greedy answers of at "
        f"most {config['max_tokens']} tokens, teacher-forced; {report['cpu']}, "
        f"{report['threads']} thread(s), {report['date']}, {report['seconds']:.0f} s.",
        f"Frequency-rule vocabularies counted on {report['vocabulary']['counted_on']} "
        f"({report['vocabulary']['answer_tokens']} tokens, {report['vocabulary']['distinct_tokens']} distinct).",
        "",
        "| measure | held-out | training |",
        "|---|---|---|",
        _row("positions (answer tokens)", splits, lambda s: str(s["positions"])),
    ]
    for name, size in sizes.items():
        label = (f"coverage: the head's vocabulary ({size})" if name == "head"
                 else f"coverage: full vocabulary ({size})" if name == "full"
                 else f"coverage: frequency rule, {size}")
        lines.append(_row(label, splits, lambda s, n=name: _pct(s["coverage"][n])))
    threshold = held.get("peakedness", {}).get("threshold", 0.5)
    lines += [
        _row(f"target top-1 probability < {threshold}", splits,
             lambda s: _pct(s["peakedness"]["share_top1_below"])),
        _row("target mean top-1 probability", splits, lambda s: f"{s['peakedness']['mean_top1']:.3f}"),
        _row("head step-0 accuracy", splits, lambda s: f"{s['head']['first_step_accuracy']:.3f}"),
        _row("head step-0 accuracy, token inside its vocabulary", splits,
             lambda s: f"{s['head']['first_step_accuracy_in_vocabulary']:.3f}"),
    ]
    buckets = held.get("head", {}).get("first_step_by_target_top1", [])
    for index, bucket in enumerate(buckets):
        low, high = bucket["range"]
        close = "]" if index == len(buckets) - 1 else ")"
        lines.append(_row(f"head step-0 accuracy where target top-1 in [{low:.1f}, {high:.1f}{close} "
                          f"(share of positions)", splits,
                          lambda s, i=index: f"{s['head']['first_step_by_target_top1'][i]['accuracy']:.3f} "
                                             f"({_pct(s['head']['first_step_by_target_top1'][i]['share'])})"))
    lines += [
        _row("head accuracy per TTT step", splits,
             lambda s: ", ".join(f"{a:.3f}" for a in s["head"]["accuracy_per_step"])),
        _row("head acceptance-length estimate", splits, lambda s: f"{s['head']['accept_length']:.2f}"),
    ]
    for entry in held.get("layerskip", []):
        by_top1 = " / ".join(f"{b['accuracy']:.2f}" for b in entry["by_target_top1"])
        lines.append(f"| layer-skip first-step agreement, skip {entry['skip_layers']} "
                     f"({entry['kept_layers']} layers run); by target top-1 bucket | "
                     f"{entry['first_step_agreement']:.3f}; {by_top1} | - |")
    mtbench = report.get("mtbench")
    if mtbench:
        rates = ", ".join(f"{r:.2f}" for r in mtbench["acceptance_rate_per_position"])
        lines += ["", f"MT-Bench (`eyas eval`, {mtbench['prompts']} first turns x "
                      f"{mtbench['max_tokens']} tokens, greedy, {mtbench['precision']}, tree "
                      f"{mtbench['tree']}): tau {mtbench['tau']}, acceptance by draft position "
                      f"{rates}; {mtbench['identical_outputs']}/{mtbench['prompts']} outputs "
                      f"identical to plain."]
    return "\n".join(lines) + "\n"
