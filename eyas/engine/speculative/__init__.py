"""Speculative decoding: proposers draft chains or trees, one target pass verifies them.

draft.py       DraftTree / VerifyResult dataclasses handed between steps
tree.py        tree attention masks, positions and paths
acceptance.py  lossless acceptance rules (greedy, chain sampling, tree sampling)
proposers/     ngram, model (separate draft model), self (the target drafts for itself),
               eagle3, medusa (K heads on the last hidden state), layerskip (the target with
               some layers skipped)
layerskip_calibrate.py  which layers layerskip:auto skips (measured once per model, cached)
policy.py      the never-slower fallback of single-stream decoding
decode.py      speculative_generate: one request through the serving engine (scheduler/)
"""
