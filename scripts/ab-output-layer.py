import torch, time, statistics
from eyas.engine.target import load_target
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.bench.prompts import mtbench_first_turns
from eyas.models.tokenizer import chat_prompt_ids
torch.set_num_threads(2)
t = load_target("smollm2-135m", dtype="int4")
screened = t.model.lm_head
class Plain(torch.nn.Module):
    def __init__(s, w): super().__init__(); s.weight_t = w
    def forward(s, x): return x @ s.weight_t
plain = Plain(screened.weight_t)
params = SamplingParams(max_tokens=128)
res = {"screened": [], "float32": []}
same = 0
for i, text in enumerate(mtbench_first_turns(8)):
    ids = chat_prompt_ids(t.tokenizer, [{"role": "user", "content": text}])
    outs = {}
    for name, layer in ([("screened", screened), ("float32", plain)] if i % 2 == 0 else [("float32", plain), ("screened", screened)]):
        t.model.lm_head = layer
        r = generate(t, ids, params)
        res[name].append(r.stats["tokens_per_s"]); outs[name] = r.token_ids
    same += outs["screened"] == outs["float32"]
t.model.lm_head = screened
for k, v in res.items(): print(k, "median tok/s", round(statistics.median(v), 1), [round(x,1) for x in v])
print("ratio of medians", round(statistics.median(res["screened"]) / statistics.median(res["float32"]), 3), "identical", same, "/ 8")
