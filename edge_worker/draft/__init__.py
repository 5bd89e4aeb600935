"""Drafting chains on the edge: the drafter (d tokens as target ids), the draft model's K/V, the lockstep batch
that shares one forward among sessions, and pre-drafting while a VERIFY is in flight."""
