"""Top-1 agreement of the int4 target with float32 on real prompts, for each activation
arithmetic of the int4 kernel (csrc/int4_gemm.cpp): MT-Bench prompts, teacher-forced on the
float32 model's own greedy continuation, every position compared. The 14-bit default must keep
the agreement that makes int4 the model users asked for; the 8-bit option is measured against
its own, lower, floor."""

import shutil

import pytest
import torch

from eyas.models import extension
from eyas.models.quant import int4_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch"),
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                       reason="no C++ compiler to build the extension"),
]

PROMPTS, POSITIONS = 16, 64
# 14 bits: the agreement users were promised (99.9%); 8 bits: 0.89 measured on the first
# prompt's 64 positions (Xeon, AVX512-VNNI), the reason 14 bits stay the default.
FLOORS = {14: 0.999, 8: 0.85}


def top1_agreement(full, quant, bits: int) -> float:
    from eyas.bench.prompts import mtbench_first_turns
    from eyas.engine.generate import generate, new_cache
    from eyas.engine.sampling import SamplingParams
    from eyas.models.tokenizer import chat_prompt_ids

    ext = extension.module()
    before = ext.int4_activation_bits()
    agree = total = 0
    try:
        ext.set_int4_activation_bits(bits)
        with torch.inference_mode():
            for question in mtbench_first_turns(None)[:PROMPTS]:
                ids = chat_prompt_ids(full.tokenizer, [{"role": "user", "content": question}])
                continuation = generate(full, ids, SamplingParams(max_tokens=POSITIONS)).token_ids
                sequence = torch.tensor([ids + continuation[:-1]])
                count = len(continuation)
                reference = full.model(sequence).logits[0, -count:].argmax(-1)
                cache = new_cache(quant, 1, sequence.shape[1])
                got = quant.model(sequence, cache=cache, write_at=0).logits[0, -count:].argmax(-1)
                agree += int((got == reference).sum())
                total += count
    finally:
        ext.set_int4_activation_bits(before)
    return agree / total


@pytest.mark.parametrize("bits", [14, 8])
def test_int4_top1_agreement_with_float32_on_mtbench(smollm_target, smollm_int4_target, bits):
    if extension.int8dot_kernel() is None:
        pytest.skip("no int8 dot-product kernel here")
    assert top1_agreement(smollm_target, smollm_int4_target, bits) >= FLOORS[bits]
