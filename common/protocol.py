"""The whole specrelay wire protocol: every message, field, enum and limit, and what a router reads of them.

A message is two ZeroMQ frames: a 2-byte header (protocol version, message type) and a MessagePack body from a
typed msgspec Struct (array_like: fields by position; trailing defaults omitted; no pickle). Probability arrays
travel as little-endian float32 `bytes` (common/packing.py). Enums travel as small ints, decode only to a member.

  edge   -> broker : [header, body]             OPEN, VERIFY, CLOSE, RESAMPLE, HEARTBEAT (liveness)
  broker -> worker : [client_id, header, body]  client_id: the edge's handle (keyed hashes of its client, then its
                                                routing id: `client_of`)
  worker -> broker : [client_id, header, body]  VERDICT, ERROR, RESAMPLED (b"": READY, HEARTBEAT, DISCONNECT)
  broker -> edge   : [header, body]             VERDICT, ERROR, RESAMPLED
  client <-> edge  : [header, body]             GENERATE, CANCEL / TOKENS, DONE, ERROR
Every session-scoped body has `session` first: the broker routes on `read_head` / `read_open`, never decoding the
rest. A session id is the edge's own, unique per edge only: broker and workers key by `SessionKey`.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from .constraint import ConstraintSpec
from .errors import ErrorCode, InvalidRequest  # noqa: F401  (ErrorCode is part of the wire)
from .logprobs import MAX_TOP, LogprobsWire
from .penalties import PenaltiesWire
from .packing import array_length, field_defaults, field_name, prefix_decoder

PROTOCOL_VERSION = 2        # 2: enums on the wire (mode, resample, kind, code)
MAX_CONTEXT = 32_768        # tokens in OPEN.tokens (prompt + history on re-prefill); a worker enforces its model's
MAX_DRAFT = 64              # draft tokens (chain) or nodes (tree) in one VERIFY; so a tree's depth <= MAX_DRAFT too
MAX_SPARSE = 16_384         # entries of a sparse QRow (a denser q travels dense: 4 bytes per target id)
MAX_TAIL = 64               # committed tokens the cloud has not seen, carried by a VERIFY
MAX_FRAME = 8 * 1024 * 1024  # MAXMSGSIZE on every socket (per frame)
MAX_FRAMES = 4              # ZeroMQ's MAXMSGSIZE limits frames, not their number: we cap it ourselves
MAX_PROMPT_CHARS = 1_000_000
HEARTBEAT_INTERVAL = 1.0    # seconds between HEARTBEATs on every link (broker <-> worker, edge -> broker)
HEARTBEAT_LIVENESS = 3      # a peer silent this many intervals is dead (lost worker, lost broker, reconnect)
DEFAULT_MAX_NEW_TOKENS = 64  # a GENERATE / HTTP request / Client call that names none (edge_worker/config.py)

U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_CONTEXT * 4)]
NodeRef = Annotated[int, msgspec.Meta(ge=-1, lt=MAX_DRAFT)]  # a tree node's index; -1: the last committed token

SessionKey = tuple[bytes, int]
"""(peer, session): the session is the edge's own number; the peer is the edge's connection: its routing id on
the broker's frontend (bound to the CURVE key it first spoke with), on a worker the broker's index (one byte) and
the handle sent in its place."""

CLIENT_TAG = 8  # a handle's first bytes: a keyed hash of the edge's client (8 bytes: no two clients alike in 2^32)


def client_of(peer: bytes) -> bytes:
    """The client behind a worker's peer: the broker's index and the handle's client tag. A broker names a client
    by the edge's CURVE key (every connection of one key is one client), else by the connection itself."""
    return peer[:1 + CLIENT_TAG]


class MsgType(enum.IntEnum):
    OPEN = 1
    VERIFY = 2
    VERDICT = 3
    CLOSE = 4
    ERROR = 5
    READY = 6
    HEARTBEAT = 7
    DISCONNECT = 8
    RESAMPLE = 9     # X-CoSD HR: edge asks the cloud to sample a server-only token
    RESAMPLED = 10
    GENERATE = 20    # client -> edge worker
    CANCEL = 21
    TOKENS = 22      # edge worker -> client, as tokens are committed
    DONE = 23


EDGE_REQUESTS = frozenset({MsgType.OPEN, MsgType.VERIFY, MsgType.CLOSE, MsgType.RESAMPLE})  # edge -> cloud
CLOUD_REPLIES = frozenset({MsgType.VERDICT, MsgType.RESAMPLED, MsgType.ERROR})             # cloud -> edge


class Mode(enum.IntEnum):
    """GREEDY: accept while draft == target argmax (temperature 0 only). SAMPLE: accept w.p. min(1, p/q'), a
    rejection resolved by the `Resample` strategy. COUPLED: shared Gumbel noise, no q travels."""

    GREEDY = 0
    SAMPLE = 1
    COUPLED = 2


class Strategy(enum.IntEnum):
    """The resampling strategy: what a rejection in SAMPLE mode sends down (common/resample.py): FULL p;
    HR p on V_c + theta_o; SRDV candidates z ~ p with p(z)."""

    FULL = 0
    HR = 1
    SRDV = 2


class Objective(enum.IntEnum):
    """What `--draft-len auto` optimises (docs/policy.md): SPEED the session's tokens per second; BALANCED the
    fewest cloud calls within a tolerance of the best speed; CLOUD the fewest cloud calls drafting can give."""

    SPEED = 0
    BALANCED = 1
    CLOUD = 2


class ResampleKind(enum.IntEnum):
    SERVER_ONLY = 0  # hr: draw from p restricted to target-only tokens
    CANDIDATES = 1   # srdv: another round of candidates
    HR = 2           # srdv gave up: send the hr payload


DEFAULT_SAMPLED_MODE = Mode.COUPLED  # at temperature > 0 when no mode is named: fewest bytes and round trips
DEFAULT_STRATEGY = Strategy.SRDV     # in SAMPLE mode when no strategy is named (docs/modes.md)
DEFAULT_OBJECTIVE = Objective.BALANCED  # what auto optimises when nobody names it (docs/policy.md)


class Base(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=False):
    pass


class Open(Base):
    """Start (or re-prefill) a session on a worker. session: chosen by the edge, unique per edge. tokens: the
    whole target-vocab context (prompt, plus the committed history when re-sending after UNKNOWN_SESSION).
    temperature/top_k/top_p: the shared transform. seed: the counter-based RNG seed. shared_vocab: V_c, bits over the
    target ids (common/bitmap.py); shared_vocab_hash: its content hash, alone it names a bitmap the worker cached;
    neither = same vocabulary. vocab_size: the target vocabulary size the edge assumes; a mismatch is refused.
    constraint: the session's grammar (structured outputs, common/constraint.py), None = none; it applies from the
    first generated token on. logprobs: the top k the VERDICTs carry (common/logprobs.py; None: none);
    prompt_logprobs: the first VERDICT also scores the prompt (echo); penalties: common/penalties.py's transform of
    the target's logits; generated: how many trailing `tokens` are generated (a re-OPEN's history), which
    penalties count apart from the prompt and the constraint must allow."""

    session: U63
    tokens: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_CONTEXT)]
    mode: Mode = Mode.GREEDY
    temperature: float = 0.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    top_p: float = 1.0
    seed: U63 = 0
    resample: Strategy = DEFAULT_STRATEGY
    shared_vocab: bytes = b""
    vocab_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    shared_vocab_hash: Annotated[bytes, msgspec.Meta(max_length=32)] = b""
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP)] | None = None
    prompt_logprobs: bool = False
    penalties: PenaltiesWire | None = None
    generated: Count = 0
    constraint: ConstraintSpec | None = None


class QRow(Base):
    """q at a branching tree node (common/tree.py): float32 probs over all target ids, or over ascending `ids`."""

    probs: bytes
    ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_SPARSE)] = []


class Verify(Base):
    """Score a draft block. pos: the edge's committed length (prompt included), so pos - len(tail) is
    what the cloud must already know. tail: committed tokens the cloud has not seen (a token the edge
    drew itself after a rejection). draft: x_1..x_d as target ids. q: float32 q(x_i) per draft token
    (sample mode only). A token tree (common/tree.py): parents, per node its parent (-1: the last committed
    token; [] = a chain), and in sample mode q_rows, the QRow of each node with 2+ children (root first)."""

    session: U63
    seq: U63
    pos: Count
    tail: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TAIL)] = []
    draft: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_DRAFT)] = []
    q: Annotated[bytes, msgspec.Meta(max_length=4 * MAX_DRAFT)] = b""
    parents: Annotated[list[NodeRef], msgspec.Meta(max_length=MAX_DRAFT)] = []
    q_rows: Annotated[list[QRow], msgspec.Meta(max_length=MAX_DRAFT // 2)] = []


CURVE_WIDTHS = (1, 4, 16, 64)  # the row widths a worker's LoadHint.curve_us times (its VERIFY cost at each)
HINT_EVERY = 4  # a worker attaches a LoadHint to a session's VERDICTs with seq % HINT_EVERY == 1 (1, 5, 9, ...)


class LoadHint(Base):
    """The worker's load when it verified a request, for the edge's draft length (edge_worker/policy):
    batch = rows in the forward pass, width = the widest row's new tokens, forward_us = its duration, queue_us =
    how long the request waited for it, tokens = all the tokens it ran (every row's uncached context and draft,
    and prompt chunks), prefill = how many were prompt chunks, busy = the worker's recent share of wall time in
    forward passes, per mille (the price of a cloud call), token_us = what one more verified token adds to a
    forward (measured by the worker at start: a slope the edge cannot learn while its rows keep one width), curve_us
    = its VERIFY's microseconds at each of CURVE_WIDTHS tokens (at start too: on a CPU the cost is not a line, and a
    tree's nodes reach widths one session's chains never show; measured once, so sent on 1 in HINT_EVERY hints only).
    On every HINT_EVERY-th VERDICT only."""

    batch: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    width: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    forward_us: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0
    queue_us: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0
    tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    prefill: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    busy: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0
    token_us: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0
    curve_us: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, le=2**40)], ...], msgspec.Meta(max_length=8)] = ()


class Verdict(Base):
    """The cloud's answer to VERIFY. n_accepted: accepted draft prefix. next_token: recovered or bonus
    token (-1: the edge resolves the rejection itself from the fields below). candidates: SR-DV draws z in
    draw order (repeats kept); cand_p: float32 p(z) once per distinct candidate, in order of first appearance.
    p: float32 target probabilities at the rejected position over the shared vocabulary (resample full | hr);
    theta_o: mass of p outside the shared vocabulary (hr). load: the worker's LoadHint (every HINT_EVERY-th
    verdict). node: a tree's deepest accepted node (-1: none; None for a chain). logprobs: the target's for the
    committed tokens, accepted then next (sessions that asked); prompt_logprobs: the prompt's, on the first. Fields are ordered so each verdict
    kind leaves the others' defaults off the end (a greedy verdict is 4 numbers, an SR-DV one carries no empty
    p / theta_o, a verdict without a hint is unchanged)."""

    session: U63
    seq: U63
    n_accepted: Count
    next_token: int = -1
    candidates: list[TokenId] = []
    cand_p: bytes = b""
    p: bytes = b""
    theta_o: float = 0.0
    load: LoadHint | None = None
    node: NodeRef | None = None
    logprobs: LogprobsWire | None = None
    prompt_logprobs: LogprobsWire | None = None


class Resample(Base):
    """Edge -> cloud after a rejection it could not resolve (ResampleKind): the verdict's with the same seq."""

    session: U63
    seq: U63
    kind: ResampleKind = ResampleKind.SERVER_ONLY
    round: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0


class Resampled(Base):
    """Cloud -> edge: token (hr server-only draw), or another SR-DV round (candidates/cand_p), or, after the
    last SR-DV round, the hr payload (p on the shared vocabulary and theta_o)."""

    session: U63
    seq: U63
    token: int = -1
    candidates: list[TokenId] = []
    cand_p: bytes = b""
    p: bytes = b""
    theta_o: float = 0.0


class Close(Base):
    session: U63


class Error(Base):
    """code: an ErrorCode (common/errors.py). message: one sentence naming the field at fault.
    seq: of the failed request (0 when unknown). `session` is the request id on the client <-> edge link."""

    session: U63
    seq: U63 = 0
    code: ErrorCode = ErrorCode.INTERNAL
    message: str = ""


class Ready(Base):
    """Worker -> broker on start: what it serves, how many sessions it takes, its KV store's token slots (0: not
    reported; its heartbeats' kv_free then means nothing)."""

    model: str = ""
    vocab_size: int = 0
    max_sessions: int = 0
    max_batch: int = 0
    kv_capacity: Annotated[int, msgspec.Meta(ge=0)] = 0


class Heartbeat(Base):
    """Both directions; from a worker it carries its load (open sessions) and its free KV token slots."""

    load: int = 0
    kv_free: Annotated[int, msgspec.Meta(ge=0)] = 0


class Disconnect(Base):
    reason: str = ""


class Generate(Base):
    """Client -> edge worker. request: client-chosen id echoed in every reply. mode None: greedy at
    temperature 0, else DEFAULT_SAMPLED_MODE (coupled). resample None: the edge's default. draft_len -1: auto."""

    request: U63
    prompt: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_CONTEXT)] = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    top_p: float = 1.0
    seed: U63 = 0
    draft_len: Annotated[int, msgspec.Meta(ge=-1, le=MAX_DRAFT)] = -1
    mode: Mode | None = None
    resample: Strategy | None = None
    objective: Objective | None = None


class Cancel(Base):
    request: U63


class Tokens(Base):
    request: U63
    token_ids: list[int]
    text: str


class Done(Base):
    request: U63
    stats: dict[str, float]


MESSAGES: dict[MsgType, type[Base]] = {
    MsgType.OPEN: Open, MsgType.VERIFY: Verify, MsgType.VERDICT: Verdict, MsgType.CLOSE: Close,
    MsgType.ERROR: Error, MsgType.READY: Ready, MsgType.HEARTBEAT: Heartbeat, MsgType.DISCONNECT: Disconnect,
    MsgType.RESAMPLE: Resample, MsgType.RESAMPLED: Resampled, MsgType.GENERATE: Generate,
    MsgType.CANCEL: Cancel, MsgType.TOKENS: Tokens, MsgType.DONE: Done,
}
TYPE_OF: dict[type[Base], MsgType] = {cls: t for t, cls in MESSAGES.items()}

_encoder = msgspec.msgpack.Encoder()
_decoders = {t: msgspec.msgpack.Decoder(cls) for t, cls in MESSAGES.items()}


def header(msg_type: MsgType) -> bytes:
    return bytes((PROTOCOL_VERSION, msg_type))


_DEFAULTS = {cls: field_defaults(cls) for cls in MESSAGES.values()}


def encode(msg: Base) -> list[bytes]:
    """Message -> [header, body] frames. Trailing fields equal to their defaults are left off the array
    (msgspec's omit_defaults does not apply to array_like structs); the decoder fills them back in."""
    values = list(msgspec.structs.astuple(msg))
    defaults = _DEFAULTS[type(msg)]
    while values and values[-1] == defaults[len(values) - 1]:
        values.pop()
    values = [0 if type(v) is float and v == 0 else v for v in values]  # 1 byte, not 9; read back as 0.0
    return [header(TYPE_OF[type(msg)]), _encoder.encode(values)]


_MSG_TYPES = {t.value: t for t in MsgType}  # a dict lookup: Enum(value) costs microseconds on the broker's path


def parse_header(frame: bytes) -> MsgType:
    if len(frame) != 2:
        raise InvalidRequest(f"header frame must be 2 bytes, got {len(frame)}", field="header")
    if frame[0] != PROTOCOL_VERSION:
        raise InvalidRequest(f"protocol version {frame[0]} is not supported (this side speaks "
                             f"{PROTOCOL_VERSION})", field="header.version")
    msg_type = _MSG_TYPES.get(frame[1])
    if msg_type is None:
        raise InvalidRequest(f"unknown message type {frame[1]}", field="header.type")
    return msg_type


def decode(frames: list[bytes], n_frames: int | None = None) -> Base:
    """[header, body] -> typed message; any defect raises InvalidRequest naming the field. n_frames: the real
    frame count when the reader kept only the first few (transport.recv_capped)."""
    n = len(frames) if n_frames is None else n_frames
    if n != 2:
        raise InvalidRequest(f"a message is 2 frames (header, body), got {n}", field="frames")
    return decode_body(parse_header(frames[0]), frames[1])


def decode_body(msg_type: MsgType, body: bytes) -> Base:
    """The body of a message whose header the caller has parsed already -> typed message (as `decode`)."""
    try:
        return _decoders[msg_type].decode(body)
    except msgspec.ValidationError as exc:
        name, field = MESSAGES[msg_type].__name__, field_name(MESSAGES[msg_type], str(exc))
        raise InvalidRequest(f"{name}.{field}: {exc}", field=field) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"{MESSAGES[msg_type].__name__} body is not valid MessagePack: {exc}",
                             field="body") from None


# ---- what a router reads: the leading fields of a body, never a tensor (the broker's whole view of a message)

# (heads are the messages' own first fields, never re-declared)
_SESSION_HEAD = prefix_decoder(Close, 1)  # every session-scoped body has `session` first
_SEQ_HEADS = {t: prefix_decoder(MESSAGES[t], 2) for t in CLOUD_REPLIES | {MsgType.VERIFY, MsgType.RESAMPLE}}
_OPEN_HEAD = prefix_decoder(Open, 2, tokens=msgspec.Raw)  # the token array undecoded: only its length is read


def session_of(body: bytes) -> int:
    """The session id of a session-scoped body (its first field), without decoding the rest."""
    try:
        return _SESSION_HEAD.decode(body).session
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(f"cannot read the session id: {exc}", field="session") from None


def session_or_zero(frames: list[bytes], index: int) -> int:
    """The session (or request) id in `frames[index]`, a body that failed to decode, for the ERROR that answers
    it: 0 when that frame is missing or its first field unreadable."""
    try:
        return session_of(frames[index]) if len(frames) > index else 0
    except InvalidRequest:
        return 0


def read_head(msg_type: MsgType, body: bytes) -> tuple[int, int]:
    """(session, seq) of a session-scoped body, decoding nothing past them; seq is 0 for OPEN / CLOSE."""
    decoder = _SEQ_HEADS.get(msg_type)
    if decoder is None:
        return session_of(body), 0
    try:
        head = decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        session_of(body)  # raises, naming the session, when that is the fault
        raise InvalidRequest(f"{msg_type.name}.seq is missing or invalid: {exc}", field="seq") from None
    return head.session, head.seq


def read_open(body: bytes) -> tuple[int, int]:
    """(session, number of prompt tokens) of an OPEN, the count read from the MessagePack array header (the
    worker validates the ids)."""
    try:
        head = _OPEN_HEAD.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        session_of(body)  # raises, naming the session, when that is the fault
        raise InvalidRequest(f"OPEN.tokens is missing or invalid: {exc}", field="tokens") from None
    n = array_length(head.tokens)  # -1: not an array
    if not 1 <= n <= MAX_CONTEXT:
        raise InvalidRequest(f"OPEN.tokens must be an array of 1..{MAX_CONTEXT} token ids, got "
                             f"{n if n >= 0 else 'no array'}", field="tokens")
    return head.session, n
