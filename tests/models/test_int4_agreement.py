"""Top-1 agreement of the int4 target with float32 on real prompts, for each activation
arithmetic of the int4 kernel (csrc/int4_gemm.cpp): MT-Bench prompts, teacher-forced on the
float32 model's own greedy continuation, every position compared. The 14-bit default must keep
the agreement that makes int4 the model users asked for; the 8-bit option is measured against
its own, lower, floor. The arithmetic is measured over a float32 KV cache; the default float16
cache (keys and values rounded once when written) is measured beside it with 14 bits."""

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
# 14 bits: the agreement users were promised, 99.89% over 4,738 positions of 40 prompts
# (BENCHMARKS.md, "Kernels and precisions"): about one flip at a near tie in these 989 positions,
# 987 measured over the float32 cache and 988 over the float16 one (Xeon, AVX512-VNNI); the floor
# allows two (987 / 989 = 0.99798) and no third (986 / 989 = 0.99697). 8 bits: 0.89 measured on
# the first prompt's 64 positions, the reason 14 bits stay the default.
FLOORS = {(14, "float32"): 0.9979, (8, "float32"): 0.85, (14, "float16"): 0.9979}


def top1_agreement(full, quant, bits: int, kv_dtype: str) -> float:
    from eyas.bench.prompts import mtbench_first_turns
    from eyas.engine.generate import generate, new_cache
    from eyas.engine.sampling import SamplingParams
    from eyas.models.tokenizer import chat_prompt_ids

    ext = extension.module()
    before, kv_before = ext.int4_activation_bits(), quant.model.kv_dtype_choice
    agree = total = 0
    try:
        ext.set_int4_activation_bits(bits)
        quant.model.kv_dtype_choice = kv_dtype
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
        quant.model.kv_dtype_choice = kv_before
    return agree / total


@pytest.mark.parametrize("bits,kv_dtype", list(FLOORS))
def test_int4_top1_agreement_with_float32_on_mtbench(smollm_target, smollm_int4_target, bits, kv_dtype):
    if extension.int8dot_kernel() is None:
        pytest.skip("no int8 dot-product kernel here")
    assert smollm_int4_target.kv_dtype == torch.float16, "float16 is the int4 target's default cache"
    assert top1_agreement(smollm_target, smollm_int4_target, bits, kv_dtype) >= FLOORS[(bits, kv_dtype)]
