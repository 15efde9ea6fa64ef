"""The output layer's int8 screen with 14-bit vs 8-bit activations (csrc/int8_screen.cpp), side
by side in one process: the candidates re-checked per row on real hidden states, and the time
of greedy_logits for 1, 4 and 16 rows (thread CPU time, medians, the two settings alternated;
thread CPU time counts the calling thread only, so run it at one thread).

    OMP_NUM_THREADS=1 python scripts/screen-activations.py [NUM_PROMPTS] [REPEATS] [REPEATS_16]
    OMP_NUM_THREADS=1 python scripts/screen-activations.py 4 25 25

The hidden states are SmolLM2-135M int4's over MT-Bench first turns and 48 greedy tokens after
each; every row's bound is checked against the float32 logits and both settings must give the
same argmax.
"""
import statistics, sys, time
import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch
from eyas.engine.target import load_target
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.bench.prompts import mtbench_first_turns
from eyas.models.tokenizer import chat_prompt_ids
from eyas.models import extension

target = load_target("smollm2-135m", dtype="int4")
ext = extension.module()
layer = target.model.lm_head
tok = target.tokenizer
prompts = [chat_prompt_ids(tok, [{"role": "user", "content": q}]) for q in mtbench_first_turns(int(sys.argv[1]) if len(sys.argv) > 1 else 8)]
hidden = []
with torch.inference_mode():
    for p in prompts:
        out = list(generate(target, p, SamplingParams(max_tokens=48)).token_ids)
        hidden.append(target.model(torch.tensor([p + out]), logits_at=None).hidden[0])
hidden = torch.cat(hidden).float()  # [T, H]
print("rows of real hidden states:", hidden.shape[0], "kernel", ext.int8dot_kernel())
exact = hidden @ layer.weight.t()
results = {}
for bits in (14, 8):
    ext.set_screen_activation_bits(bits)
    with torch.inference_mode():
        approx, bound = layer.screen(hidden)
        screened = layer.greedy_logits(hidden)
    cand = (approx + bound >= (approx - bound).amax(1, keepdim=True)).sum(1).float()
    ok = bool(((exact - approx).abs() <= bound).all()) and torch.equal(screened.argmax(-1), exact.argmax(-1))
    results[bits] = screened.argmax(-1)
    print(f"{bits}-bit: bound holds and argmax exact: {ok}; candidates/row mean {cand.mean():.2f} median {cand.median():.0f} "
          f"p90 {cand.quantile(0.9):.0f} max {cand.max():.0f}; mean bound {bound.mean():.4f}")
assert torch.equal(results[14], results[8])
g = torch.Generator().manual_seed(0)
times = {(b, r): [] for b in (14, 8) for r in (1, 4, 16)}
with torch.inference_mode():
    for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 15):
        for r in (1, 4, 16):
            idx = torch.randint(0, hidden.shape[0], (r,), generator=g)
            x = hidden[idx]
            for b in ((14, 8) if rep % 2 else (8, 14)):
                ext.set_screen_activation_bits(b)
                t = time.thread_time()
                layer.greedy_logits(x)
                times[(b, r)].append(time.thread_time() - t)
for r in (1, 4, 16):
    a, b = statistics.median(times[(14, r)]) * 1e3, statistics.median(times[(8, r)]) * 1e3
    print(f"rows {r:2d}: 14-bit {a:.2f} ms, 8-bit {b:.2f} ms, ratio {b / a:.3f}")
for b in (14, 8):
    m1, m16 = statistics.median(times[(b, 1)]), statistics.median(times[(b, 16)])
    print(f"{b}-bit slope 1->16 rows: {(m16 - m1) / 15 * 1e3:.3f} ms/row")
# screen alone (no re-check), 16 rows, and greedy at 16 rows again, interleaved
ts = {(b, k): [] for b in (14, 8) for k in ("screen", "greedy")}
with torch.inference_mode():
    for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 15):
        idx = torch.randint(0, hidden.shape[0], (16,), generator=g)
        x = hidden[idx]
        for b in ((14, 8) if rep % 2 else (8, 14)):
            ext.set_screen_activation_bits(b)
            t = time.thread_time(); layer.screen(x); ts[(b, "screen")].append(time.thread_time() - t)
            t = time.thread_time(); layer.greedy_logits(x); ts[(b, "greedy")].append(time.thread_time() - t)
for k in ("screen", "greedy"):
    a, b = statistics.median(ts[(14, k)]) * 1e3, statistics.median(ts[(8, k)]) * 1e3
    print(f"16 rows {k}: 14-bit {a:.2f} ms, 8-bit {b:.2f} ms, ratio {b / a:.3f}")
