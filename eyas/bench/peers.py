"""The peers of `eyas bench offline`: transformers `generate` (plain, prompt lookup, assisted)
and llama.cpp, each as a runner `prompt ids -> generated ids` (greedy, EOS cut, EOS not counted).

Systems:
    hf                 transformers generate, float32
    hf-lookup          its prompt lookup decoding (6 tokens)
    hf-assisted:DRAFT  its assisted generation with DRAFT as the assistant model (an alias such
                       as smollm2-135m, a Hugging Face folder or a .gguf file; it must share the
                       target's tokenizer). The only same-tokenizer pair embedded is SmolLM2-135M
                       drafting for itself: a check of the machinery, not a speedup.
    llama.cpp          llama-cpp-python over the GGUF (an embedded alias or a .gguf path)

Usage:
    from eyas.bench.peers import hf_runner, peer_systems
    run, name = hf_runner("/path/to/model", max_tokens=64, assistant="smollm2-135m")
    generated = run(prompt_ids)
    peer_systems("smollm2-135m")  # ['llama.cpp', 'hf-lookup', 'hf-assisted:smollm2-135m', 'hf']
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable

import torch

from eyas.errors import EyasError

Runner = Callable[[list[int]], list[int]]  # prompt ids -> generated ids

PROMPT_LOOKUP_TOKENS = 6


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_path(model: str) -> Path | None:
    """The GGUF file behind a model spec: an embedded alias or a .gguf path; else None."""
    from eyas.models.registry import ALIASES, package_dir

    entry = ALIASES.get(model)
    if entry is not None and entry.parts:  # joined by `make qwen` into the cache
        from eyas.models.parts import joined_path

        return joined_path(entry.filename) if joined_path(entry.filename).is_file() else None
    if entry is not None:
        folder = package_dir(entry.package)
        return folder / entry.filename if folder is not None else None
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def peer_systems(model: str, draft: str | None = None, with_llama_cpp: bool | None = None) -> list[str]:
    """Every peer this machine can run for `model`, plain transformers last (the reference row).

    hf-assisted drafts with `draft`'s model when it is `model:M` (the eyas draft-model spec),
    else with the target itself. llama.cpp is listed when llama-cpp-python imports (or
    `with_llama_cpp` says so) and the model has a GGUF.
    """
    if with_llama_cpp is None:
        with_llama_cpp = llama_cpp_available()
    assistant = model
    if draft is not None and draft.startswith("model:") and len(draft) > len("model:"):
        assistant = draft[len("model:"):]
    systems = ["llama.cpp"] if with_llama_cpp and gguf_path(model) is not None else []
    return systems + ["hf-lookup", f"hf-assisted:{assistant}", "hf"]


def _load_hf(folder: str | Path) -> Any:
    from transformers import AutoModelForCausalLM

    from eyas.models.weight_source import gguf_file

    gguf = gguf_file(Path(folder))
    if gguf is not None:  # a resolved GGUF folder holds no weights: transformers reads the GGUF
        return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _check_same_tokenizer(target_folder: str, draft_folder: Path, draft: str) -> None:
    from eyas.models.tokenizer import load_tokenizer

    if load_tokenizer(target_folder).get_vocab() != load_tokenizer(str(draft_folder)).get_vocab():
        raise EyasError(f"hf-assisted:{draft}: the draft's tokenizer differs from the target's; "
                        "assisted generation here needs the same tokenizer (e.g. "
                        "hf-assisted:smollm2-135m for the embedded SmolLM2)")


def hf_runner(folder: str, max_tokens: int, lookup: bool = False,
              assistant: str | None = None) -> tuple[Runner, str]:
    """transformers generate on the target folder, float32, greedy; `lookup` adds prompt lookup
    decoding, `assistant` (a model spec) assisted generation with that draft model."""
    from eyas.models.registry import resolve_model

    model = _load_hf(folder)
    extra: dict[str, Any] = {}
    name = "transformers generate"
    if lookup:
        extra["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        name += f" + prompt lookup ({PROMPT_LOOKUP_TOKENS})"
    if assistant is not None:
        draft_folder = resolve_model(assistant)
        _check_same_tokenizer(folder, draft_folder, assistant)
        extra["assistant_model"] = _load_hf(draft_folder)  # its own copy, even drafting for itself
        name += f" + assisted ({assistant})"
    eos = model.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))

    @torch.inference_mode()
    def run(ids: list[int]) -> list[int]:
        inputs = torch.tensor([ids])  # [1, S]
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                             max_new_tokens=max_tokens, **extra)
        generated = out[0, len(ids):].tolist()
        # like eyas and llama.cpp here: the EOS token ends the answer and is not counted
        cut = next((i for i, token in enumerate(generated) if token in eos_ids), len(generated))
        return generated[:cut]

    return run, name + " (float32)"


def llama_cpp_runner(model: str, max_tokens: int) -> tuple[Runner, str] | None:
    """None when llama-cpp-python is missing or the model has no GGUF. Like eyas's runners, it
    prefills every prompt whole on torch's thread count: llama-cpp-python would otherwise keep
    the KV rows of the previous prompt's common prefix (the chat template's system turn) and
    prefill prompts on every core."""
    path = gguf_path(model)
    if not llama_cpp_available() or path is None:
        return None
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=4096, verbose=False)

    def run(ids: list[int]) -> list[int]:
        llm.reset()  # no prefix kept from the prompt before
        out: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if token == llm.token_eos() or len(out) >= max_tokens:
                break
            out.append(token)
        return out

    return run, "llama.cpp (GGUF, plain)"
