"""The whole specrelay wire protocol: every message, field and limit, in one place.

A message is two ZeroMQ frames: a 2-byte header (protocol version, message type) and a MessagePack body
encoded from a typed msgspec Struct (array_like: fields travel by position, no names; trailing defaults
are omitted). No pickle anywhere. Probability arrays travel as little-endian float32 `bytes`.

Socket topology (edge DEALER -> broker frontend ROUTER; broker backend ROUTER <- worker DEALER):
  edge   -> broker : [header, body]                      OPEN, VERIFY, CLOSE, RESAMPLE, HEARTBEAT (liveness)
  broker -> worker : [client_id, header, body]           the broker prepends the edge's handle (a keyed
                                                         16-byte hash of its routing id, never the id)
  worker -> broker : [client_id, header, body]           VERDICT/ERROR/RESAMPLED (client_id b"" for
                                                         READY, HEARTBEAT, DISCONNECT)
  broker -> edge   : [header, body]                      VERDICT, ERROR, RESAMPLED
  client <-> edge  : [header, body]                      GENERATE, CANCEL / TOKENS, DONE, ERROR
Every session-scoped body has `session` as its first field so the broker can route without decoding the
rest (`SessionHeader`). A session id is chosen by the edge and unique per edge only: broker and workers key a
session by `SessionKey` = (peer, session), so edges number their sessions 1, 2, ... and the id costs one byte
in most messages. The broker never decodes tensors. Enumerations (mode, strategy, kind, code) travel as one
small int each and decode only to a known member.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated

import msgspec

from .errors import ErrorCode, InvalidRequest  # noqa: F401  (ErrorCode is part of the wire)

PROTOCOL_VERSION = 2        # 2: enums on the wire (mode, resample, kind, code)
MAX_CONTEXT = 32_768        # tokens in OPEN.tokens (prompt + history on re-prefill); a worker enforces its model's
MAX_DRAFT = 64              # draft tokens (chain) or nodes (tree) in one VERIFY; so a tree's depth <= MAX_DRAFT too
MAX_SPARSE = 16_384         # entries of a sparse QRow (a denser q travels dense: 4 bytes per target id)
MAX_TAIL = 64               # committed tokens the cloud has not seen, carried by a VERIFY
MAX_FRAME = 8 * 1024 * 1024  # MAXMSGSIZE on every socket (per frame)
MAX_FRAMES = 4              # ZeroMQ's MAXMSGSIZE limits frames, not their number: we cap it ourselves
MAX_PROMPT_CHARS = 1_000_000

U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_CONTEXT * 4)]
NodeRef = Annotated[int, msgspec.Meta(ge=-1, lt=MAX_DRAFT)]  # a tree node's index; -1: the last committed token

SessionKey = tuple[bytes, int]
"""(peer, session): the session is the edge's own number; the peer is the edge's connection: its routing id on
the broker's frontend (the broker binds a routing id to the CURVE key it first spoke with), and on a worker the
handle the broker sends in its place (`client_id`). Broker, Verifier and batcher key every session by it."""


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
    """GREEDY: accept while draft == target argmax (temperature 0, and only then). SAMPLE: accept w.p.
    min(1, p/q'), a rejection resolved by the `Resample` strategy. COUPLED: shared Gumbel noise, no q travels."""

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
    """What `--draft-len auto` optimises (edge_worker/draftlen.py, docs/draftlen.md): SPEED the session's tokens
    per second; BALANCED the fewest cloud calls among lengths within a tolerance of the best speed; CLOUD the
    fewest cloud calls drafting can give (the longest drafts that still pay)."""

    SPEED = 0
    BALANCED = 1
    CLOUD = 2


class ResampleKind(enum.IntEnum):
    SERVER_ONLY = 0  # hr: draw from p restricted to target-only tokens
    CANDIDATES = 1   # srdv: another round of candidates
    HR = 2           # srdv gave up: send the hr payload


DEFAULT_SAMPLED_MODE = Mode.COUPLED  # at temperature > 0 when no mode is named: fewest bytes and round trips
DEFAULT_STRATEGY = Strategy.SRDV     # in SAMPLE mode when no strategy is named (docs/benchmarks-first.md)
DEFAULT_OBJECTIVE = Objective.BALANCED  # what auto optimises when nobody names it (docs/draftlen.md)


def enum_value(kind: type[enum.IntEnum], value, field: str):
    """A member of `kind` from a member, its int or its name in any case ('srdv' -> Strategy.SRDV); None stays
    None. Anything else raises InvalidRequest naming the field and the choices (the Python API's boundary)."""
    if value is None or isinstance(value, kind):
        return value
    try:
        return kind[value.upper()] if isinstance(value, str) else kind(value)
    except (KeyError, ValueError):
        choices = ", ".join(m.name.lower() for m in kind)
        raise InvalidRequest(f"{field} must be one of {choices}, got {value!r}", field=field) from None


class Base(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=False):
    pass


class SessionHeader(Base):
    """The first field of every session-scoped body; all the broker ever decodes."""

    session: U63


class Open(Base):
    """Start (or re-prefill) a session on a worker.

    session: id chosen by the edge, unique per edge; broker and workers key it by (peer, session).
    tokens: the whole target-vocab context (prompt, plus the committed history when re-sending after
    UNKNOWN_SESSION). temperature/top_k/top_p: the shared transform. seed: the counter-based RNG seed.
    shared_vocab: the shared vocabulary V_c as a packed bitmap over the target ids (numpy packbits, little bit
    order); b"" = same vocabulary (V_c = all). vocab_size: the target vocabulary size the edge's noise and q'
    rows assume; the worker refuses a mismatch (0: unchecked).
    """

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


HINT_EVERY = 4  # a worker attaches a LoadHint to a session's VERDICTs with seq % HINT_EVERY == 1 (1, 5, 9, ...)


class LoadHint(Base):
    """The worker's load when it verified a request, for the edge's goodput-driven draft length
    (edge_worker/draftlen.py): batch = rows in the forward pass, width = the widest row's new tokens, forward_us =
    its duration, queue_us = how long the request waited in the worker before it, tokens = all the tokens it ran
    (what its duration grows with: every row's uncached context and draft, and prompt chunks), prefill = how many
    of them were prompt chunks of sessions not verifying yet, busy = the share of the worker's recent wall time
    spent in forward passes, per mille (its utilisation: the price of a cloud call). Seven small ints; sent on
    every HINT_EVERY-th VERDICT only. The trailing ones are 0 from a worker older than them."""

    batch: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    width: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    forward_us: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0
    queue_us: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0
    tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    prefill: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    busy: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0


class Verdict(Base):
    """The cloud's answer to VERIFY. n_accepted: accepted draft prefix. next_token: recovered or bonus
    token (-1: the edge resolves the rejection itself from the fields below). candidates: SR-DV draws z in
    draw order (repeats kept); cand_p: float32 p(z) once per distinct candidate, in order of first appearance.
    p: float32 target probabilities at the rejected position over the shared vocabulary (resample full | hr);
    theta_o: mass of p outside the shared vocabulary (hr). load: the worker's LoadHint (every HINT_EVERY-th
    verdict). node: a tree's deepest accepted node (-1: none; None for a chain). Fields are ordered so each verdict
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


class Resample(Base):
    """RESAMPLE, edge -> cloud after a rejection it could not resolve (see ResampleKind). Refers to the
    rejection of the verdict with the same seq."""

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
    """Worker -> broker on start: what it serves and how many sessions it takes. kv_capacity: token slots in its
    KV store (0: not reported; then its heartbeats' kv_free means nothing)."""

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
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_CONTEXT)] = 64
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
_session_decoder = msgspec.msgpack.Decoder(SessionHeader)


def header(msg_type: MsgType) -> bytes:
    return bytes((PROTOCOL_VERSION, msg_type))


def _defaults(cls: type[Base]) -> tuple:
    info = msgspec.structs.fields(cls)
    return tuple(f.default if f.default is not msgspec.NODEFAULT else f.default_factory() if
                 f.default_factory is not msgspec.NODEFAULT else msgspec.NODEFAULT for f in info)


_DEFAULTS = {cls: _defaults(cls) for cls in MESSAGES.values()}


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
    msg_type = parse_header(frames[0])
    try:
        return _decoders[msg_type].decode(frames[1])
    except msgspec.ValidationError as exc:
        name, field = MESSAGES[msg_type].__name__, _field_name(MESSAGES[msg_type], str(exc))
        raise InvalidRequest(f"{name}.{field}: {exc}", field=field) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"{MESSAGES[msg_type].__name__} body is not valid MessagePack: {exc}",
                             field="body") from None


def _field_name(cls: type[Base], error: str) -> str:
    """msgspec reports array_like positions as `$[i]`; turn that into the field's name."""
    m = re.search(r"\$\[(\d+)\]", error)
    if not m:
        return "body"
    i = int(m.group(1))
    return cls.__struct_fields__[i] if i < len(cls.__struct_fields__) else f"[{i}]"


def session_of(body: bytes) -> int:
    """The session id of a session-scoped body (its first field), without decoding the rest."""
    try:
        return _session_decoder.decode(body).session
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(f"cannot read the session id: {exc}", field="session") from None


def session_or_zero(frames: list[bytes], index: int) -> int:
    """The session (or request) id in `frames[index]`, a body that failed to decode, for the ERROR that answers
    it: 0 when that frame is missing or its first field unreadable."""
    try:
        return session_of(frames[index]) if len(frames) > index else 0
    except InvalidRequest:
        return 0


def f32(values) -> bytes:
    """float32 little-endian bytes of a 1-D tensor / sequence."""
    import numpy as np

    if hasattr(values, "detach"):
        values = values.detach().to("cpu").float().numpy()
    return np.asarray(values, dtype="<f4").tobytes()


def from_f32(data: bytes, expected: int | None = None, field: str = "p"):
    """bytes -> float32 torch tensor [n]; checks the length (and, if given, the element count)."""
    import numpy as np
    import torch

    if len(data) % 4:
        raise InvalidRequest(f"{field} must be float32 bytes (length divisible by 4), got {len(data)}", field=field)
    arr = np.frombuffer(data, dtype="<f4")
    if expected is not None and arr.shape[0] != expected:
        raise InvalidRequest(f"{field} has {arr.shape[0]} values, expected {expected}", field=field)
    if not (np.isfinite(arr).all() and (arr >= 0).all()):
        raise InvalidRequest(f"{field} must hold finite probabilities >= 0", field=field)
    return torch.from_numpy(arr.copy())
