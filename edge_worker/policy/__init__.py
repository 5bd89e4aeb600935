"""The edge's draft policy: per round and per session, the shape to draft (d = 0, a chain of d, a tree) and
whether to pre-draft. The model (docs/policy.md states it with its measurements):

    E(d) = sum_{k=0..d} P_k,  P_k = prod_{j<k} a_j        tokens a chain of d commits per cloud call
    E(S) = E(d) + sum over its side nodes of their reach  the same for a tree (reach from the rank chances P_r)
    T    = D(F(d + lookahead - pre-drafted start)) + W(d) + H     seconds a round takes

with one set of estimators per edge (estimates.py) and one objective rule for chains and trees (choose.pick)."""

from .choose import MAX_LEN, TOLERANCE, DraftPolicy, chain_rows, pick, static_tree, tree_rows
from .estimates import PREDRAFT_SHARE, AcceptanceCounts, EdgeEstimates, EWLine, EWMean, RankAcceptance
