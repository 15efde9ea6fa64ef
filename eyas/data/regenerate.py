"""`eyas data regenerate`: let the target write the answers, turn by turn, resumably.

Usage:
    eyas data regenerate --input data/prepared/train.jsonl --output data/regen.jsonl \
        --endpoint http://gpu-1:8000 --endpoint http://gpu-2:8000 --concurrency 32
    eyas data regenerate --input data/prepared/train.jsonl --output data/regen.jsonl \
        --model smollm2-135m --concurrency 32 --max-tokens 256
    eyas data regenerate --input data/prepared/train.jsonl --output data/regen.jsonl \
        --model /models/SmolLM2-135M-Instruct --device cuda --concurrency 512 --dtype float32

Each input record's user turns (and system prompt) are kept; its answers, if any, are thrown
away and written again by the target: turn 1 is answered, the answer joins the history, turn 2
is answered on that regenerated history, and so on. In-process, the serving engine decodes
`--concurrency` conversations at once with continuous batching (regenerate_engine.py);
`--batch-size N` selects the older fixed batches instead. Records whose id is already in the output
are skipped, and each finished record is appended in one atomic write, so a run stopped at any
point (Ctrl-C, a crash, an endpoint that went down) resumes where it stopped, with no record
written twice and none lost. `--limit N` caps the records in the output, so a rerun after N
adds none. A report lands beside the output (`OUTPUT.report.json`).

Before any prompt reaches the target, each input record is screened: a second record under an
id already read (`duplicate_id`), a user turn that is null (`null_turn`) or blank
(`empty_turn`), or no user turn (`no_user_turn`) is rejected, and the PII/DLP filter of `eyas
data prepare` (same options, same `PiiFilter`) redacts or drops the record (`pii:TYPE`). Every
rejected record is counted by reason and the first 200 are listed with their line numbers.

Greedy (temperature 0, the default) or sampled: greedy answers are the target's most likely
continuation, which is what a greedy serving deployment verifies against, and reproducible; a
sampled dataset (e.g. temperature 0.7, top-p 0.95) covers more of what the target may write,
which helps acceptance when the head will serve sampling requests, at the cost of noisier
targets and no reproducibility without a seed. See docs/data.md.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tqdm import tqdm

from eyas.data.endpoint import Answer, EndpointClient, EndpointConfig, EndpointDown, RequestFailed, SamplingConfig
from eyas.data.pii.policy import PiiConfig, PiiFilter, PiiReport, scanned_types
from eyas.data.regenerate_engine import run_with_engine
from eyas.data.records import Conversation, EmptyTurnError, RecordError, conversation_from_dict, raw_record_id
from eyas.data.resume import ResumableJsonl
from eyas.data.sources import RawError, read_raw_records, resolve_source
from eyas.errors import EyasError
from eyas.utils.io import write_json_atomic


@dataclass
class RegenerateConfig:
    input: str  # a prepared jsonl (or any source `eyas data prepare` reads)
    output: Path
    endpoint: EndpointConfig | None = None  # answers from a server ...
    model: str | None = None  # ... or from the target in-process (alias, folder or .gguf)
    dtype: str = "auto"  # in-process precision (eyas.engine.target.PRECISIONS)
    device: str = "cpu"  # in-process: where the target runs (cpu, cuda, cuda:N)
    concurrency: int = 32  # in-process: conversations in flight in the serving engine
    batch_size: int | None = None  # in-process: fixed batches of N instead of the engine (reference path)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    limit: int | None = None  # at most this many records in the output (those already there count)
    pii: PiiConfig = field(default_factory=PiiConfig)  # the filter `eyas data prepare` applies
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.endpoint is None) == (self.model is None):
            raise EyasError("give exactly one of --endpoint URL (a server) or --model SPEC (in-process)")
        if self.endpoint is not None and self.device != "cpu":
            raise EyasError(f"--device {self.device} places the in-process target (--model); "
                            f"an --endpoint serves its own")
        if self.batch_size is not None and self.batch_size < 1:
            raise EyasError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.concurrency < 1:
            raise EyasError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.limit is not None and self.limit < 1:
            raise EyasError(f"--limit must be >= 1, got {self.limit}")
        self.output = Path(self.output)


MAX_LISTED_REJECTED = 200  # rejected records listed one by one in the report (all are counted)


@dataclass
class RegenerateReport:
    written: int = 0
    already_done: int = 0
    failed: Counter[str] = field(default_factory=Counter)  # records not written, by reason
    rejected: Counter[str] = field(default_factory=Counter)  # input records refused, by reason
    rejected_records: list[dict[str, Any]] = field(default_factory=list)  # the first MAX_LISTED_REJECTED
    malformed_lines: list[int] = field(default_factory=list)
    pii: PiiReport = field(default_factory=PiiReport)
    limit_reached: bool = False  # the output already held --limit records before this run
    completion_tokens: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    model_load_seconds: float = 0.0  # in-process: loading the target, not counted in tokens/s
    stopped: str = ""  # why the run stopped early, if it did

    def reject(self, reason: str, line: int, record_id: str) -> None:
        self.rejected[reason] += 1
        if len(self.rejected_records) < MAX_LISTED_REJECTED:
            self.rejected_records.append({"line": line, "id": record_id, "reason": reason})

    def to_dict(self) -> dict[str, Any]:
        generating = self.seconds - self.model_load_seconds
        return {
            "written": self.written,
            "already_done": self.already_done,
            "limit_reached": self.limit_reached,
            "failed": dict(self.failed),
            "rejected": dict(self.rejected.most_common()),
            "rejected_records": self.rejected_records,
            "pii": self.pii.to_dict(),
            "malformed_lines": self.malformed_lines[:200],
            "malformed": len(self.malformed_lines),
            "completion_tokens": self.completion_tokens,
            "finish_reasons": dict(self.finish_reasons),
            "seconds": round(self.seconds, 2),
            "model_load_seconds": round(self.model_load_seconds, 2),
            "tokens_per_second": round(self.completion_tokens / generating, 2) if generating > 0 else 0.0,
            "stopped": self.stopped,
        }


def prompt_history(conversation: Conversation) -> tuple[list[dict[str, str]], list[str]]:
    """(the system prompt as a message list, the user turns to answer in order)."""
    system = conversation.system_prompt
    history = [{"role": "system", "content": system}] if system else []
    return history, conversation.user_turns


def regenerated_record(conversation: Conversation, history: list[dict[str, str]], answers: list[Answer], by: str) -> dict[str, Any]:
    meta = dict(conversation.meta)
    meta["regenerated"] = {
        "by": by,
        "finish_reasons": [answer.finish_reason for answer in answers],
        "completion_tokens": sum(answer.completion_tokens for answer in answers),
    }
    return {"id": conversation.id, "source": conversation.source, "conversations": history, "meta": meta}


def _pending(config: RegenerateConfig, done: set[str], report: RegenerateReport) -> list[Conversation]:
    """The records still to regenerate, screened (see the module docstring), at most `wanted`."""
    report.pii = PiiReport(types=scanned_types(config.pii))
    wanted = None if config.limit is None else config.limit - len(done)
    if wanted is not None and wanted <= 0:
        report.limit_reached, report.already_done = True, len(done)  # the input need not be read
        return []
    source = resolve_source(config.input)
    pii_filter = PiiFilter(config.pii) if config.pii.enabled else None
    if pii_filter is not None:
        report.pii = pii_filter.report
    seen: set[str] = set()
    pending: list[Conversation] = []
    for item in read_raw_records(source):
        if isinstance(item, RawError):
            report.malformed_lines.append(item.line)
            continue
        fallback_id = f"{source.name}-{item.line}"
        try:
            conversation = conversation_from_dict(item.value, source.name, fallback_id, reject_empty_turns=True)
        except EmptyTurnError as error:
            report.reject(error.reason, item.line, raw_record_id(item.value, fallback_id))
            continue
        except RecordError:
            report.malformed_lines.append(item.line)
            continue
        # 1. One record per id: the first one read wins, in every run alike.
        if conversation.id in seen:
            report.reject("duplicate_id", item.line, conversation.id)
            continue
        seen.add(conversation.id)
        if conversation.id in done:
            report.already_done += 1
            continue
        if not conversation.user_turns:
            report.reject("no_user_turn", item.line, conversation.id)
            continue
        # 2. The PII/DLP filter of `eyas data prepare`: drop the record or redact its text.
        if pii_filter is not None:
            outcome = pii_filter.apply(conversation)
            if outcome.drop_reason is not None:
                report.reject(outcome.drop_reason, item.line, conversation.id)
                continue
            conversation = outcome.conversation
        pending.append(conversation)
        if wanted is not None and len(pending) == wanted:
            break  # the rest of the input is read by the run that continues past this limit
    if not pending and not report.already_done:
        rejected = ", ".join(f"{reason}: {count}" for reason, count in report.rejected.most_common())
        raise EyasError(f"'{config.input}' has no usable record ({len(report.malformed_lines)} malformed lines"
                        f"{'; rejected ' + rejected if rejected else ''})")
    return pending


def run_regenerate(config: RegenerateConfig) -> RegenerateReport:
    report = RegenerateReport()
    output = ResumableJsonl(config.output)
    done = output.done_ids()
    pending = _pending(config, done, report)
    started = time.perf_counter()
    bar = tqdm(total=len(pending), desc="regenerate", unit=" rec", disable=not config.progress)
    try:
        if pending and config.endpoint is not None:
            asyncio.run(_run_endpoint(config, pending, output, report, bar, started))
        elif pending and config.batch_size is None:
            run_with_engine(config, pending, output, report, bar, started)
        elif pending:
            _run_in_process(config, pending, output, report, bar, started)
    except EndpointDown as error:
        report.stopped = str(error)
        raise EyasError(
            f"{error}. Stopped: {report.written} records written in this run "
            f"({report.written + report.already_done} in total) are kept in {config.output}; "
            "run the same command again to resume"
        ) from error
    finally:
        bar.close()
        report.seconds = time.perf_counter() - started
        write_json_atomic(config.output.with_name(config.output.name + ".report.json"), report.to_dict())
    return report


def record_written(report: RegenerateReport, answers: list[Answer], bar: Any, started: float) -> None:
    report.written += 1
    report.completion_tokens += sum(answer.completion_tokens for answer in answers)
    report.finish_reasons.update(answer.finish_reason for answer in answers)
    elapsed = max(time.perf_counter() - started, 1e-9)
    bar.set_postfix_str(f"{report.completion_tokens / elapsed:.1f} tok/s", refresh=False)
    bar.update(1)


# ---------------------------------------------------------------------------------------------
# Through an OpenAI-compatible endpoint: `concurrency` conversations in flight.
async def _run_endpoint(config: RegenerateConfig, pending: list[Conversation], output: ResumableJsonl,
                        report: RegenerateReport, bar: Any, started: float) -> None:
    assert config.endpoint is not None
    queue: Iterator[Conversation] = iter(pending)
    async with EndpointClient(config.endpoint, config.sampling) as client:

        async def worker() -> None:
            for conversation in queue:  # shared iterator: each record goes to one worker
                history, user_turns = prompt_history(conversation)
                answers: list[Answer] = []
                try:
                    for user_turn in user_turns:
                        history.append({"role": "user", "content": user_turn})
                        answer = await client.chat(history)
                        history.append({"role": "assistant", "content": answer.text})
                        answers.append(answer)
                except RequestFailed as error:
                    report.failed[str(error).split(":")[0]] += 1
                    bar.update(1)
                    continue
                output.append(regenerated_record(conversation, history, answers, f"endpoint:{client.model}"))
                record_written(report, answers, bar, started)

        workers = [asyncio.create_task(worker()) for _ in range(config.endpoint.concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)


# ---------------------------------------------------------------------------------------------
# In-process, fixed batches (`batch_size`): one turn of `batch_size` conversations at a time.
# The default in-process path is the serving engine (regenerate_engine.py); this one is kept as
# its reference (greedy answers equal) and for comparing the two.
def length_sorted_batches(pending: list[Conversation], batch_size: int, window_batches: int = 8
                          ) -> Iterator[list[Conversation]]:
    """Batches of conversations of similar length, in input order window by window.

    Each step's decode pass reads every row's keys up to the longest row's context (masked
    beyond its own), so rows of similar length waste the least. Sorting the whole input would
    let a run stopped early hold only short prompts; sorting each window of `window_batches`
    batches keeps what is done at any point a fair sample of the input.
    """
    window = batch_size * window_batches
    for start in range(0, len(pending), window):
        chunk = sorted(pending[start : start + window],
                       key=lambda c: sum(map(len, c.user_turns)) + len(c.system_prompt or ""))
        for begin in range(0, len(chunk), batch_size):
            yield chunk[begin : begin + batch_size]


def _run_in_process(config: RegenerateConfig, pending: list[Conversation], output: ResumableJsonl,
                    report: RegenerateReport, bar: Any, started: float) -> None:
    from eyas.data.templates import TemplateError, render_prompt
    from eyas.engine.generate import SamplingParams, generate_batch
    from eyas.engine.target import load_target

    assert config.model is not None
    target = load_target(config.model, dtype=config.dtype, device=config.device)
    report.model_load_seconds = time.perf_counter() - started
    started = time.perf_counter()  # tokens/s counts decoding only
    sampling = config.sampling
    params = SamplingParams(
        max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, seed=sampling.seed,
    )
    context = target.config.context_length
    by = f"in-process:{config.model}"
    for batch in length_sorted_batches(pending, config.batch_size):
        histories = [prompt_history(conversation) for conversation in batch]
        answers: list[list[Answer]] = [[] for _ in batch]
        failed: set[int] = set()
        for turn in range(max(len(user_turns) for _, user_turns in histories)):
            # 1. The prompt of every conversation that has this turn, rendered by the target's template.
            rows, prompts = [], []
            for row, (history, user_turns) in enumerate(histories):
                if row in failed or turn >= len(user_turns):
                    continue
                history.append({"role": "user", "content": user_turns[turn]})
                try:
                    prompt = render_prompt(target.tokenizer, history)
                except TemplateError:
                    failed.add(row)
                    report.failed["template_error"] += 1
                    continue
                if len(prompt) >= context - 1:
                    failed.add(row)
                    report.failed["prompt_too_long"] += 1
                    continue
                rows.append(row)
                prompts.append(prompt)
            # 2. Decode them together; each answer joins its history.
            for row, result in zip(rows, generate_batch(target, prompts, params) if prompts else []):
                histories[row][0].append({"role": "assistant", "content": result.text})
                answers[row].append(Answer(result.text, len(result.token_ids), result.finish_reason))
        # 3. Write the finished conversations (one atomic append each).
        for row, conversation in enumerate(batch):
            if row in failed:
                bar.update(1)
                continue
            output.append(regenerated_record(conversation, histories[row][0], answers[row], by))
            record_written(report, answers[row], bar, started)
