"""Drafting across vocabularies: the byte mapping between the draft's and the target's tokens, the context sync
(target ids -> text -> draft ids), and the drafter whose model has its own tokenizer."""
