"""The edge's draft policy: per round and per session, the shape to draft (d = 0, a chain of d, a tree) and
whether to pre-draft. The whole model (docs/policy.md):

    E(d) = sum_{k=0..d} P_k,  P_k = prod_{j<k} a_j        tokens a chain of d commits per cloud call
    E(S) = 1 + sum over the tree's nodes of their reach    the same for a tree (reach from the rank chances P_r)
    T    = D(F(d + lookahead - pre-drafted start)) + W(d) seconds a round takes (a tree: one forward a level)

with one set of estimators per edge (estimates.py), every session's rounds pooled: acceptance per draft position
(and per confidence class and rank for trees); t, the draft's seconds per forward against the columns it runs;
D(n), a round's measured wait for n fresh forwards (a line: a part per round, one per forward; trees' against
their levels' compute); F(n), the draft forwards n target tokens take (n with one vocabulary,
across vocabularies a line: a round's alignment forward and a slope); W(d), the wait from VERIFY to VERDICT,
anchored at the mean wait measured at the mean row and growing by (1 + q) c1 B per token (the worker's forward
if every row of its batch drafted one more, and the wait for the forward ahead, q of a forward; c1 and q from
the load hints, c1 shrunk toward the worker's own measure of a token). A pre-draft runs on the otherwise idle
draft thread during the wait, so a block's start it drafted costs nothing. One objective rule picks among chains
(d = 0 included) and trees alike (choose.pick): of the candidates whose rate E / T is within the objective's
tolerance of the best, the most tokens per call (`speed` 0: the fastest; `balanced` 10 %; `cloud` any); with
`--trees auto` a tree replaces the chain it picks only if modelled no slower and no fewer tokens per call. A draft
slower than the verify it saves loses by the model. Exploring d = 0: a round drafts d = 1 (an acceptance sample)
once the edge's rounds at d = 0 since the last sample took 1 / EXPLORE_SHARE x what the last exploring round's
draft cost (its catch-up on the stretch the draft had not seen), so exploring costs ~3 % where drafting does not
pay (less where a pre-draft's guess at the next token is the sample: the round stays at d = 0). The block after
the prompt is priced at the openings' own acceptance, a drafting one also at its catch-up on the prompt (at d = 0
a pre-draft runs it during the wait, or a later drafting round pays it).
"""

from .choose import MAX_LEN, TOLERANCE, DraftPolicy, chain_rows, pick, static_tree, tree_rows, tree_time
from .estimates import PREDRAFT_SHARE, AcceptanceCounts, EdgeEstimates, EWLine, EWMean, RankAcceptance

__all__ = ["MAX_LEN", "PREDRAFT_SHARE", "TOLERANCE", "AcceptanceCounts", "DraftPolicy", "EWLine", "EWMean",
           "EdgeEstimates", "RankAcceptance", "chain_rows", "pick", "static_tree", "tree_rows", "tree_time"]
