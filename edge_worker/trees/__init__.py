"""Token trees on the edge: a session's draft tree, its nodes' K/V, drafting trees one batched forward per depth,
and a session's tree rounds (VERIFY, VERDICT, the fallback to chains)."""
