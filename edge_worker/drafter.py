"""Drafting on the edge: d tokens from the draft model, proposed as TARGET ids from the shared vocabulary.

The draft samples from q' = q restricted to the shared vocabulary V_c and renormalised (TLI), so standard
rejection sampling against p stays exact; with the same vocabulary V_c is everything and q' = q.
Every draw uses counter-based randomness at the token's absolute position (common.rng).
`draft_batch` drafts for many sessions in lockstep: one batched draft-model forward per draft position.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ..common.protocol import Mode
from ..common.rng import Purpose, gumbel, sample_index, uniform
from ..common.runner import ModelRunner, common_prefix
from ..common.sampling import SamplingParams, probs_from_logits
from .draftkv import LockstepKV, SessionKV, Workspace
from .drafttree import DraftTree, adopt
from .treedraft import TreeBlock, TreeJob, draft_trees


@dataclass
class DraftState:
    """One session's draft-model state: ids whose K/V are held, the K/V, logits after the last id. Inside a
    lockstep batch the new positions' K/V sit in the batch until it ends (`LockstepKV.close`)."""

    ids: list[int] = field(default_factory=list)
    kv: SessionKV = field(default_factory=SessionKV)
    last_logits: torch.Tensor | None = None  # [V_draft]
    tree: DraftTree | None = None  # the draft tree hanging from `ids` (edge_worker/treedraft.py), its K/V in kv.nodes

    def sync(self, context: list[int]) -> None:
        """Keep only the cached prefix that `context` still starts with (rejected drafts are dropped); a draft
        tree's nodes on the committed path join the history, the rest are dropped (drafttree.adopt)."""
        if self.tree is not None:
            ids, self.tree = adopt(self.tree, self.kv, self.ids, context)
            if ids != self.ids:
                self.ids, self.last_logits = ids, None
        n = len(self.ids)
        if n <= len(context) and self.ids == context[:n]:
            return
        common = common_prefix(self.ids, context)
        self.ids, self.last_logits = self.ids[:common], None
        self.kv.truncate(common)

    def reset(self) -> None:
        """Forget everything (a draft batch failed half-way): the next draft re-runs the whole context."""
        self.ids, self.last_logits, self.tree = [], None, None
        self.kv.clear()


@dataclass
class DraftJob:
    """What one session needs drafted: up to d tokens after `context` (draft-model ids)."""

    state: DraftState
    context: list[int]
    position: int          # absolute position (target sequence) of the first draft token
    d: int
    mode: Mode
    params: SamplingParams
    seed: int


@dataclass
class DraftBlock:
    ids: list[int] = field(default_factory=list)               # x_1..x_d as target ids
    q_tok: list[float] = field(default_factory=list)           # q'(x_i) (sample mode)
    q_rows: list[torch.Tensor] = field(default_factory=list)   # q' over the target vocabulary, [V_target] each
    drafted: list[int] = field(default_factory=list)          # draft-vocabulary ids, when `finish` converts them
    steps: int = 0  # lockstep steps of the batch that drafted it (its longest job), set by DraftBatcher

    def part(self, start: int, stop: int | None = None) -> "DraftBlock":
        """Tokens start..stop-1 with their q' (q lists are empty outside sample mode)."""
        return DraftBlock(self.ids[start:stop], self.q_tok[start:stop], self.q_rows[start:stop])

    def __add__(self, other: "DraftBlock") -> "DraftBlock":
        return DraftBlock(self.ids + other.ids, self.q_tok + other.q_tok, self.q_rows + other.q_rows)


class Drafter:
    """Holds the draft model (same vocabulary as the target); proposes blocks for many sessions at once."""

    trees = True  # drafts token trees of target ids (edge_worker/treedraft.py)

    def __init__(self, runner: ModelRunner, target_vocab_size: int | None = None) -> None:
        self.runner = runner
        self.target_vocab_size = target_vocab_size or runner.vocab_size
        self.eos_ids = runner.eos_ids  # target ids that end a generation (same tokenizer)
        self.shared_mask = None        # [V_target] bool of V_c; None = everything
        self._workspaces = threading.local()  # lockstep K/V buffers, reused batch after batch, one per thread

    # ------------------------------------------------------------------ per-vocabulary hooks
    def new_state(self, prompt_ids: list[int]) -> DraftState:
        return DraftState()

    def draft_context(self, state: DraftState, target_tokens: list[int]) -> list[int]:
        """The draft model's context for the committed target tokens (same vocabulary: the same ids)."""
        return target_tokens

    def shared_bitmap(self) -> bytes:
        return b""

    def to_target(self, q: torch.Tensor) -> torch.Tensor:  # q: [V_draft] -> q' [V_target]
        """Same tokenizer, possibly a different embedding size: V_c = ids valid in both."""
        v = self.target_vocab_size
        if q.shape[0] == v:
            return q
        out = q.new_zeros(v)
        n = min(v, q.shape[0])
        out[:n] = q[:n]
        return out / out.sum()

    def to_draft(self, target_id: int) -> int:
        return target_id

    # ------------------------------------------------------------------ drafting
    def choose(self, logits: torch.Tensor, job: DraftJob, pos: int, block: DraftBlock) -> int:
        """Pick the next draft token (a target id) from draft logits [V_draft] at absolute position pos."""
        if job.mode == Mode.GREEDY:
            return int(self.to_target(torch.softmax(logits.float(), -1)).argmax())
        q = self.to_target(probs_from_logits(logits, job.params))  # [V_target] q'
        if job.mode == Mode.COUPLED:  # argmax(log q' + g) with the noise the target will use
            return int((q.double().log() + gumbel(job.seed, pos, q.shape[0])).argmax())
        x = sample_index(q, uniform(job.seed, pos, Purpose.DRAFT))
        block.q_tok.append(float(q[x]))
        block.q_rows.append(q)
        return x

    def workspace(self) -> Workspace:
        workspace = getattr(self._workspaces, "buffer", None)
        if workspace is None:  # edges sharing this drafter draft in their own threads: never share a buffer
            workspace = self._workspaces.buffer = Workspace()
        return workspace

    def draft_batch(self, jobs: list[DraftJob | TreeJob]) -> list[DraftBlock | TreeBlock]:
        """Draft every job in lockstep: at each step, ONE forward over the sessions still drafting. Tree jobs
        (edge_worker/treedraft.py) form a lockstep batch of their own."""
        if any(isinstance(j, TreeJob) for j in jobs):
            trees = [i for i, j in enumerate(jobs) if isinstance(j, TreeJob)]
            chains = [i for i, j in enumerate(jobs) if not isinstance(j, TreeJob)]
            out: list = [None] * len(jobs)
            for i, block in zip(trees, draft_trees(self, [jobs[i] for i in trees], self.workspace())):
                out[i] = block
            for i, block in zip(chains, self.draft_batch([jobs[i] for i in chains]) if chains else []):
                out[i] = block
            return out
        blocks = [DraftBlock() for _ in jobs]
        contexts = [list(j.context) for j in jobs]
        live = [i for i, j in enumerate(jobs) if j.d > 0]
        workspace = self.workspace()
        batch = LockstepKV(self.runner, workspace)
        try:
            while live:
                self._advance(batch, [jobs[i] for i in live], [contexts[i] for i in live], live)
                live = [i for i in live if self.step(jobs[i], blocks[i], contexts[i])]
            batch.close()
        except BaseException:
            for job in jobs:  # their K/V may be half in the batch: start them over rather than trust it
                job.state.reset()
            raise
        for job, block in zip(jobs, blocks):
            self.finish(job, block)
        return blocks

    def step(self, job: DraftJob, block: DraftBlock, context: list[int]) -> bool:
        """One draft token from `job.state.last_logits`: record it, extend `context` (draft ids). Returns whether
        the job wants another token."""
        x = self.choose(job.state.last_logits, job, job.position + len(block.ids), block)
        block.ids.append(x)
        context.append(self.to_draft(x))
        return len(block.ids) < job.d and x not in self.eos_ids

    def finish(self, job: DraftJob, block: DraftBlock) -> None:
        """Turn what `step` drafted into the block that travels (nothing to do with one vocabulary)."""

    def _advance(self, batch: LockstepKV, jobs: list[DraftJob], contexts: list[list[int]], keys: list[int]) -> None:
        """Bring each job's state up to its context and refresh last_logits (one batched forward)."""
        states = [job.state for job in jobs]
        if batch.buf is None:  # before the batch holds their K/V, states may roll back (rejected drafts)
            for state, ctx in zip(states, contexts):
                state.sync(ctx)
                if len(state.ids) == len(ctx) and state.last_logits is None:  # logits lost to a rollback
                    state.sync(ctx[:-1])                                      # re-run the last id
        feeds = [ctx[len(state.ids):] for state, ctx in zip(states, contexts)]
        if batch.buf is None and not any(feeds):  # every next token comes from logits already held
            return
        room = max(job.d for job in jobs)
        logits = batch.feed(keys, [s.kv for s in states], [len(s.ids) for s in states], feeds, room)
        for row, (state, ctx, fed) in enumerate(zip(states, contexts, feeds)):
            if fed:
                state.ids = list(ctx)
                state.last_logits = logits[row, len(fed) - 1]
