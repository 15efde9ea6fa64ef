"""Grammar masks (llguidance): the mask depends on the completion's ids alone, whichever way
the matcher reached them; drafts the grammar forbids are pruned from a hand-made tree."""

from __future__ import annotations

import json
import random

import pytest
import torch

from eyas.engine.grammar import GrammarError, GrammarSpec, compile_grammar
from eyas.engine.logits_process import process_tree_rows
from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.prune import lead_with_forced, prune_draft, prune_tree

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def person(smollm_tokenizer):
    return compile_grammar(GrammarSpec("json_schema", SCHEMA), smollm_tokenizer, len(smollm_tokenizer))


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_valid_answer_is_allowed_token_by_token_and_ends_with_eos(person, smollm_tokenizer):
    ids = encode(smollm_tokenizer, '{"name": "Bob", "age": 42}')
    constraint = person.constraint()
    for position, token in enumerate(ids):
        assert constraint.accepts(ids[:position], token)
    assert not constraint.accepts([], encode(smollm_tokenizer, "hello")[0])
    end = constraint.allowed(ids)
    assert end.nonzero().flatten().tolist() == [smollm_tokenizer.eos_token_id]  # only EOS now
    assert constraint.finished(ids) and not constraint.finished(ids[:-1])


def test_masks_do_not_depend_on_the_order_positions_are_asked(person, smollm_tokenizer):
    ids = encode(smollm_tokenizer, '{"name": "Ann Lee", "age": 7}')
    fresh = [person.constraint().allowed(ids[:n]) for n in range(len(ids) + 1)]
    walked = person.constraint()
    order = list(range(len(ids) + 1))
    random.Random(0).shuffle(order)
    for n in order + order[::-1]:  # back and forth: rollbacks and advances
        walked.masks.clear()
        assert torch.equal(walked.allowed(ids[:n]), fresh[n])


def test_process_tree_rows_masks_every_node_with_its_path(person, smollm_tokenizer):
    ids = encode(smollm_tokenizer, '{"name": "Bob", "age": 42}')
    vocab = len(smollm_tokenizer)
    tree = DraftTree(torch.tensor(ids[1:4]), torch.tensor([0, 1, 2]))  # a chain after the root
    logits = torch.zeros(4, vocab)
    constraint = person.constraint()
    out = process_tree_rows(logits, [constraint], ids[:1], tree)
    for row in range(4):
        expected = person.constraint().allowed(ids[: row + 1])
        assert torch.equal(torch.isfinite(out[row]), expected)


def test_pruning_drops_forbidden_nodes_and_their_subtrees(person, smollm_tokenizer):
    ids = encode(smollm_tokenizer, '{"name": "Bob", "age": 42}')
    bad = encode(smollm_tokenizer, " hello")[0]
    #       root (after ids[0])
    #       ├── 1 ids[1] ── 3 ids[2] ── 5 bad ── 6 ids[3]
    #       │            └─ 4 ids[2]
    #       └── 2 bad ── 7 ids[2]
    tokens = [ids[1], bad, ids[2], ids[2], bad, ids[3], ids[2]]
    parents = [0, 0, 1, 1, 3, 5, 2]
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    pruned, node_map = prune_tree(tree, [person.constraint()], ids[:1])
    assert pruned.tokens.tolist() == [ids[1], ids[2], ids[2]]
    assert pruned.parents.tolist() == [0, 1, 1]
    assert node_map == [1, 0, 2, 3, 0, 0, 0]


def test_pruning_without_a_grammar_keeps_the_tree(smollm_tokenizer):
    tree = DraftTree.chain([5, 6, 7])
    same, node_map = prune_tree(tree, [lambda ids, row: row], [1])
    assert same is tree and node_map == [1, 2, 3]


def test_a_pruned_chain_keeps_its_draft_probabilities(person, smollm_tokenizer):
    ids = encode(smollm_tokenizer, '{"name": "Bob", "age": 42}')
    bad = encode(smollm_tokenizer, " hello")[0]
    probs = torch.rand(3, 8)
    tree = DraftTree.chain([ids[1], bad, ids[3]], probs)
    pruned, node_map = prune_tree(tree, [person.constraint()], ids[:1])
    assert pruned.tokens.tolist() == [ids[1]] and torch.equal(pruned.draft_probs, probs[:1])
    assert node_map == [1, 0, 0]


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", {"type": "objectx"}), "objectx"),
    (GrammarSpec("json_schema", {"properties": {"a": {"$ref": "#/nope"}}}), "nope"),
    (GrammarSpec("json_schema", "{}"), "JSON object"),
    (GrammarSpec("regex", "(("), "unclosed"),
    (GrammarSpec("choice", []), "non-empty"),
])
def test_bad_grammars_raise_an_error_that_says_why(spec, message, smollm_tokenizer):
    with pytest.raises(GrammarError, match=message):
        compile_grammar(spec, smollm_tokenizer, len(smollm_tokenizer))


def test_choices_and_json_object(smollm_tokenizer):
    vocab = len(smollm_tokenizer)
    choice = compile_grammar(GrammarSpec("choice", ["yes", "no"]), smollm_tokenizer, vocab).constraint()
    assert choice.finished(encode(smollm_tokenizer, "yes"))
    assert not choice.accepts([], encode(smollm_tokenizer, "maybe")[0])
    anything = compile_grammar(GrammarSpec("json_object"), smollm_tokenizer, vocab).constraint()
    text = json.dumps({"a": [1, {"b": None}]})
    assert anything.finished(encode(smollm_tokenizer, text))


def test_prune_draft_tells_the_proposer_where_its_nodes_went(person, smollm_tokenizer):
    ids = encode(smollm_tokenizer, '{"name": "Bob", "age": 42}')
    bad = encode(smollm_tokenizer, " hello")[0]

    class Renumbered:
        told = None

        def renumber(self, node_map, size):
            self.told = (node_map, size)

    proposer = Renumbered()
    tree = DraftTree(torch.tensor([bad, ids[1], ids[2], ids[3]]), torch.tensor([0, 0, 2, 3]))
    pruned = prune_draft(proposer, tree, [person.constraint()], ids[:1], budget=2)
    assert pruned.tokens.tolist() == [ids[1], ids[2]] and pruned.parents.tolist() == [0, 1]
    assert proposer.told == ([0, 1, 2, 0], 2)


def test_forced_tokens_lead_the_tree_and_keep_what_grows_below(person, smollm_tokenizer):
    ids = encode(smollm_tokenizer, '{"name": "Bob", "age": 42}')
    constraint = person.constraint()
    assert constraint.forced([]) == ids[:3]  # {"name":
    assert constraint.forced(ids[:3]) == []  # a free choice follows
    # tree: 1 ids[0] - 2 ids[1] - 3 ids[2] - 4 x ; 5 y under the root (pruned away by the grammar
    # anyway); the chain ids[0..2] is in the tree, node 4 grows below it
    x = ids[3]
    tree = DraftTree(torch.tensor([ids[0], ids[1], ids[2], x]), torch.tensor([0, 1, 2, 3]))
    led, node_map = lead_with_forced(tree, ids[:3], budget=5)
    assert led.tokens.tolist() == ids[:4] and led.parents.tolist() == [0, 1, 2, 3]
    assert node_map == [1, 2, 3, 4]
    # a tree off the chain is replaced by the chain
    other = DraftTree(torch.tensor([ids[0], x]), torch.tensor([0, 1]))
    led, node_map = lead_with_forced(other, ids[:3], budget=2)
    assert led.tokens.tolist() == ids[:2] and node_map == [1, 0]
    # through prune_draft: an empty draft becomes the forced chain
    drafted = prune_draft(None, DraftTree.empty(), [constraint], [], budget=4)
    assert drafted.tokens.tolist() == ids[:3] and drafted.parents.tolist() == [0, 1, 2]
