"""The EAGLE-3 draft head: config, module, draft vocabulary and checkpoint (shared by training
and the engine)."""

from eyas.eagle3.checkpoint import load_head, read_head_config, save_head
from eyas.eagle3.config import Eagle3Config, default_target_layer_ids
from eyas.eagle3.head import DraftStepOutput, Eagle3Head
from eyas.eagle3.vocab import DraftVocab, build_draft_vocab, count_answer_tokens

__all__ = [
    "DraftStepOutput",
    "DraftVocab",
    "Eagle3Config",
    "Eagle3Head",
    "build_draft_vocab",
    "count_answer_tokens",
    "default_target_layer_ids",
    "load_head",
    "read_head_config",
    "save_head",
]
