"""Helpers of the token-tree tests: a drafter that knows the target, and HF's own greedy output."""

from __future__ import annotations

import torch

from specrelay.treeref import TreeDrafter, TreeShape


class Oracle(TreeDrafter):
    """A tree drafter that knows the target (it drafts with it), always branches, and puts the target's own
    choice at a different sibling index at each depth: trees whose accepted paths run through every branch."""

    def __init__(self, runner, shape=TreeShape(depth=4, branch=2, nodes=30, unsure=2.0)):
        super().__init__(runner, runner.vocab_size, shape)

    @staticmethod
    def _children(logits, q, k, mode, seed, position):
        kids = TreeDrafter._children(logits, q, k, mode, seed, position)
        shift = position % max(1, len(kids))
        return kids[shift:] + kids[:shift]


def hf_greedy(runner, ids: list[int], n: int) -> list[int]:
    return runner.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=runner.tokenizer.eos_token_id)[0, len(ids):].tolist()
