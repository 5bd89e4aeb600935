"""The edge's draft policy: per round and per session, the shape to draft (d = 0, a chain of d, a tree) and
whether to pre-draft. The whole model (docs/policy.md):

    E(d) = sum_{k=0..d} P_k,  P_k = prod_{j<k} a_j        tokens a chain of d commits per cloud call
    E(S) = 1 + sum over the tree's nodes of their reach    the same for a tree (reach from the rank chances P_r)
    T    = D(F(d + lookahead - pre-drafted start)) + W(d) + H     seconds a round takes (a tree: a forward a level,
                                                              and the others' chain jobs' wait behind it)

with one set of estimators per edge (estimates.py), every session's rounds pooled: acceptance per draft position (a
session's own, shrunk toward it, prices its chain) and per confidence class and rank for trees; t, the draft's
seconds per forward against its columns; D(n), a round's measured wait for n fresh forwards (a line: a part per
round, one per forward); F(n), the draft forwards n target tokens take (across vocabularies a line: an alignment
forward and a slope); W(d), the wait from VERIFY to VERDICT, the mean wait at the mean row plus (1 + q) c1 B per
token (the worker's forward if every row drafted one more, and q of one ahead; from the load hints); H, the edge's
own time a round besides them (d = 0, d > 0). A pre-draft runs on the idle draft thread during the wait, so a block's
start it drafted costs nothing (a chain after a tree round, or a tree after a chain round, has none: that switch is
paid once over the tokens left). One objective rule picks among chains (d = 0 included) and trees alike (choose.pick):
of the candidates whose rate E / T is within the objective's tolerance of the best, the most tokens per call (`speed`
0; `balanced` 10 %; `cloud` any); with `--trees auto` a tree replaces the chain only if modelled no slower and no
fewer tokens per call. Exploring at d = 0 (EXPLORE_SHARE) and the openings (after the prompt): choose.DraftPolicy.
"""

from .choose import MAX_LEN, TOLERANCE, DraftPolicy, chain_rows, pick, static_tree, tree_rows
from .estimates import PREDRAFT_SHARE, AcceptanceCounts, EdgeEstimates, EWLine, EWMean, RankAcceptance
