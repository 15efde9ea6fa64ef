"""Tiny random Hugging Face models built from a config inside the tests (no hub access)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch


@contextmanager
def single_thread() -> Iterator[None]:
    """Tiny tensors run fastest on one thread (and do not stall on a busy second core)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

TINY_DEFAULTS = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                     pad_token_id=2)


def build_tiny_model(folder: Path, tokenizer, model_type: str = "llama", seed: int = 0,
                     **overrides) -> Path:
    """Save a random Hugging Face model of `model_type` (+ the SmolLM2 tokenizer) to `folder`."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_class, model_class = classes[model_type]
    torch.manual_seed(seed)
    config = config_class(**{**TINY_DEFAULTS, **overrides})
    model = model_class(config).eval()
    # Random init gives near-uniform logits; scale the output layer up so that greedy choices
    # are decisive, as in a trained model (ties would make token equality tests meaningless).
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_word_level_target(folder: Path, vocab: int = 256, hidden_size: int = 32, intermediate_size: int = 64,
                            num_hidden_layers: int = 8, max_position_embeddings: int = 256,
                            chat_template: str | None = None) -> Path:
    """Save a random Llama over a word-level tokenizer of `vocab` words t0..t{vocab-1} (no
    packaged model needed), its output layer peaked so that its argmax is not a coin toss."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return folder
