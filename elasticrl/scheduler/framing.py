"""The trajectory path's protobuf wire format, by hand: result batches as a worker sends them, and
groups as the coordinator checks, stores and serves them, without building protobuf messages.

Why by hand (``bench/scheduler.py``'s stream section on the 2-core development VM: 1 MiB result
batches of 4 groups x 8 samples x 4096 tokens): upb copies every bytes field into an arena when it
builds or parses a message, again into a new buffer when it serializes one, and again into a new
``bytes`` on every read of a field, and each fresh megabyte costs ~1 ms of page faults on that
machine. A worker spent ~2 ms building and serializing a batch; the coordinator parsed it into an
arena and copied every sample out again (and the shard writer then built tensors of them). Here a
worker joins its samples' bytes into the message once, and the coordinator walks the message's
fields where they lie (~80 us per MiB), keeping each group as a slice of the bytes it received:
the shard file gets those bytes as they are (``store``, format v3), and so does the trainer that
fetches the group (with the fields the coordinator adds appended: protobuf merges concatenated
messages).

The layout is the protobuf wire format of ``proto/elasticrl/v1/scheduler.proto`` (varint keys,
LEN-prefixed bytes, proto3 defaults left out); the generated classes parse what is built here and
the other way round, which ``tests/unit/test_scheduler_framing.py`` checks. Handled: ``Sample``,
``TrajectoryGroup`` fields 1-6 (what a worker fills), ``ResultBatch``, ``WorkRequest.results`` and
``FetchShardResponse``. A group that carries anything else (the fields the coordinator fills, a
field unknown here, a field twice) is rebuilt from what was read, so what is stored and served is
always exactly those fields.
"""

from __future__ import annotations

import math
import struct

from elasticrl.coordinator import validate as v
from elasticrl.errors import InvalidRequestError
from elasticrl.scheduler.state import GroupRecord, SampleRecord

_F32 = struct.Struct("<f")
_F64 = struct.Struct("<d")
_U64 = (1 << 64) - 1
_ONE_BYTE = [bytes([n]) for n in range(0x80)]
_ZERO_F32 = b"\x00" * 4
_ZERO_F64 = b"\x00" * 8
_REWARD_KEY = bytes([0x1D])

# Keys (field number << 3 | wire type), one byte each for the fields used here.
# Sample
_IDS, _LPS, _REWARD, _REASON, _TEXT, _MASK, _TURNS, _ENV_S, _TRUNCATED = (
    0x0A, 0x12, 0x1D, 0x22, 0x2A, 0x32, 0x38, 0x45, 0x48)
# TrajectoryGroup
_G_ITERATION, _G_TASK_ID, _G_SAMPLE, _G_POLICY_VERSION, _G_GEN_S, _G_REWARD_S = 0x08, 0x12, 0x1A, 0x20, 0x29, 0x31
# ResultBatch, WorkRequest, FetchShardResponse
_B_GROUP, _B_BATCH_ID = 0x0A, 0x12
_W_RESULTS = 0x12
_F_GROUP, _F_TOTAL_GROUPS, _F_TOTAL_TOKENS = 0x0A, 0x10, 0x18


class FramingError(ValueError):
    """Bytes that are not a well-formed message (truncated, a length past the end, a wire type
    that does not exist): the whole message is refused, as a protobuf parser would refuse it."""


# -- primitives ------------------------------------------------------------------------------


def varint(n: int) -> bytes:
    """``n`` (>= 0, or a negative int64 as its 64-bit two's complement) as a protobuf varint."""
    if 0 <= n < 0x80:
        return _ONE_BYTE[n]
    n &= _U64
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _f32(x: float) -> bytes:
    """``x`` as a float32, beyond its range as infinity (as upb stores a too large double)."""
    try:
        return _F32.pack(x)
    except OverflowError:
        return _F32.pack(math.copysign(math.inf, x))


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    b = buf[i]
    if b < 0x80:
        return b, i + 1
    result, shift = b & 0x7F, 7
    i += 1
    while True:
        b = buf[i]
        result |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return result & _U64, i
        shift += 7
        if shift > 63:
            raise FramingError("a varint longer than 10 bytes")


def _read_len(buf: bytes, i: int, end: int) -> tuple[int, int]:
    """A LEN field's payload: (its start, its end)."""
    n, j = _read_varint(buf, i)
    if j - i > 5:
        raise FramingError("a length written in more than 5 bytes")  # as upb refuses it
    i = j
    if i + n > end:
        raise FramingError(f"a field of {n} bytes runs past the end of its message")
    return i, i + n


def _skip(buf: bytes, i: int, end: int, key: int) -> int:
    """Past the value of a field this code does not read (``key`` already consumed)."""
    wire_type = key & 7
    if key >> 3 == 0:
        raise FramingError("field number 0 (no message has one)")
    if wire_type == 0:
        _, i = _read_varint(buf, i)
    elif wire_type == 1:
        i += 8
    elif wire_type == 2:
        _, i = _read_len(buf, i, end)
    elif wire_type == 5:
        i += 4
    else:
        raise FramingError(f"wire type {wire_type} (field {key >> 3}): only varint, fixed and length-delimited fields are read")
    if i > end:
        raise FramingError("a field runs past the end of its message")
    return i


def _key(buf: bytes, i: int) -> tuple[int, int]:
    key = buf[i]
    return (key, i + 1) if key < 0x80 else _long_key(buf, i)


def _long_key(buf: bytes, i: int) -> tuple[int, int]:
    """A key of more than one byte: a field number of 16 or more, or a small one written long
    (which protobuf reads as that field). Like upb, at most 5 bytes and 32 bits."""
    key, j = _read_varint(buf, i)
    if j - i > 5 or key > 0xFFFFFFFF:
        raise FramingError("a field key longer than 32 bits")
    return key, j


def _text(buf: bytes, at: tuple[int, int], field: str) -> str:
    try:
        return str(buf[at[0]:at[1]], "utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"{field}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _utf8(buf: bytes, start: int, end: int) -> bool:
    try:
        str(buf[start:end], "utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- encoding --------------------------------------------------------------------------------


def _len_prefix(key: int, n: int) -> bytes:
    """A LEN field's key and length, cached by (key, length): samples of one run repeat a few
    lengths (a worker builds 32 samples per 1 MiB batch; building each prefix took ~1 us)."""
    prefix = _PREFIXES.get((key, n))
    if prefix is None:
        prefix = _ONE_BYTE[key] + varint(n)
        if len(_PREFIXES) < _MAX_PREFIXES:
            _PREFIXES[(key, n)] = prefix
    return prefix


_PREFIXES: dict[tuple[int, int], bytes] = {}
_MAX_PREFIXES = 4096


def _sample_parts(parts: list, ids, lps, reward: float, reason: bytes, text: bytes, mask, turns: int,
                  env_s: float, truncated: bool) -> int:
    """Append one ``Sample`` message's buffers to ``parts``; returns their length. Fields in
    number order, each once, a proto3 default left out (as upb writes them)."""
    n = 0
    size = len(ids)
    if size:
        prefix = _len_prefix(_IDS, size)
        parts += (prefix, ids)
        n += len(prefix) + size
    size = len(lps)
    if size:
        prefix = _len_prefix(_LPS, size)
        parts += (prefix, lps)
        n += len(prefix) + size
    r = _f32(reward)
    if r != _ZERO_F32:  # proto3 leaves out a zero (all bits), as upb does
        parts += (_REWARD_KEY, r)
        n += 5
    if reason:
        prefix = _len_prefix(_REASON, len(reason))
        parts += (prefix, reason)
        n += len(prefix) + len(reason)
    if text:
        prefix = _len_prefix(_TEXT, len(text))
        parts += (prefix, text)
        n += len(prefix) + len(text)
    size = len(mask)
    if size:
        prefix = _len_prefix(_MASK, size)
        parts += (prefix, mask)
        n += len(prefix) + size
    if turns:
        t = varint(turns & 0xFFFFFFFF)
        parts += (_ONE_BYTE[_TURNS], t)
        n += 1 + len(t)
    e = _f32(env_s)
    if e != _ZERO_F32:
        parts += (_ONE_BYTE[_ENV_S], e)
        n += 5
    if truncated:
        parts += (_ONE_BYTE[_TRUNCATED], b"\x01")
        n += 2
    return n


def _group_parts(parts: list, iteration: int, task_id: bytes, policy_version: int, gen_seconds: float,
                 reward_seconds: float, samples: list[tuple[list, int]]) -> int:
    """Append one ``TrajectoryGroup`` message (fields 1-6) to ``parts``; ``samples``: each sample's
    (buffers, length). Returns the group's length."""
    n = 0
    if iteration:
        v = varint(iteration)
        parts += (_ONE_BYTE[_G_ITERATION], v)
        n += 1 + len(v)
    if task_id:
        v = varint(len(task_id))
        parts += (_ONE_BYTE[_G_TASK_ID], v, task_id)
        n += 1 + len(v) + len(task_id)
    for sample, size in samples:
        v = varint(size)
        parts += (_ONE_BYTE[_G_SAMPLE], v)
        parts += sample
        n += 1 + len(v) + size
    if policy_version:
        v = varint(policy_version)
        parts += (_ONE_BYTE[_G_POLICY_VERSION], v)
        n += 1 + len(v)
    for key, value in ((_G_GEN_S, gen_seconds), (_G_REWARD_S, reward_seconds)):
        d = _F64.pack(value)
        if d != _ZERO_F64:
            parts += (_ONE_BYTE[key], d)
            n += 9
    return n  # counted as it goes: a pass over the parts cost ~15 us per 1 MiB batch


def group_parts(iteration: int, g: GroupRecord | WireGroup) -> tuple[list, int]:
    """The ``TrajectoryGroup`` message (fields 1-6) of ``g`` as buffers to write one after the
    other, and their total length. A ``WireGroup`` is its received bytes, uncopied."""
    if isinstance(g, WireGroup):
        wire = g.wire
        return [wire], len(wire)
    samples = []
    for s in g.samples:
        sp: list = []
        size = _sample_parts(sp, s.completion_ids, s.logprobs, s.reward, s.finish_reason.encode(), s.text.encode(),
                             s.loss_mask, s.turns, s.env_s, s.truncated)
        samples.append((sp, size))
    parts: list = []
    n = _group_parts(parts, iteration, g.task_id.encode(), g.policy_version, g.gen_seconds, g.reward_seconds, samples)
    return parts, n


def result_batch_request(groups: list[tuple[int, GroupRecord]], batch_id: str) -> bytes:
    """``WorkRequest(results=ResultBatch(groups=..., batch_id=...))``, serialized: what a worker
    sends for its finished groups (``(iteration, group)`` pairs), the sample bytes copied once."""
    parts: list = []
    body = 0
    for iteration, g in groups:
        gp, n = group_parts(iteration, g)
        v = varint(n)
        parts += (_ONE_BYTE[_B_GROUP], v)
        parts += gp
        body += 1 + len(v) + n
    bid = batch_id.encode()
    if bid:
        v = varint(len(bid))
        parts += (_ONE_BYTE[_B_BATCH_ID], v, bid)
        body += 1 + len(v) + len(bid)
    return b"".join([_ONE_BYTE[_W_RESULTS], varint(body), *parts])


def fetch_response(groups: list[tuple[list, int]], total_groups: int, total_tokens: int) -> bytes:
    """``FetchShardResponse``, serialized; ``groups``: each group's (buffers, length), as
    ``group_parts`` gives them plus the fields the coordinator appends."""
    parts: list = []
    for gp, n in groups:
        parts += (_ONE_BYTE[_F_GROUP], varint(n))
        parts += gp
    if total_groups:
        parts += (_ONE_BYTE[_F_TOTAL_GROUPS], varint(total_groups))
    if total_tokens:
        parts += (_ONE_BYTE[_F_TOTAL_TOKENS], varint(total_tokens))
    return b"".join(parts)


# -- decoding --------------------------------------------------------------------------------


def result_batch_spans(data: bytes) -> tuple[str, list[tuple[int, int]]] | None:
    """Where a serialized ``WorkRequest`` that holds a ``ResultBatch`` (and nothing else) keeps its
    groups: (batch id, [(start, end) of each group's message]). None for any other request (a
    hello, a release) and for results in a form protobuf must merge (another field beside them, a
    long key, a batch in pieces): parse those with the generated class.

    Raises:
        FramingError: the bytes are not a well-formed message.
    """
    try:
        if not data or data[0] != _W_RESULTS:
            return None
        start, end = _read_len(data, 1, len(data))
        if end != len(data):
            return None  # more than the results field: let the protobuf parser apply its rules
        batch_id, spans = "", []
        i = start
        while i < end:
            key, i = _key(data, i)
            if key == _B_GROUP:
                a, i = _read_len(data, i, end)
                spans.append((a, i))
            elif key == _B_BATCH_ID:
                a, i = _read_len(data, i, end)
                try:
                    batch_id = str(data[a:i], "utf-8")
                except UnicodeDecodeError:
                    raise FramingError("results.batch_id: not valid UTF-8") from None
            else:
                i = _skip(data, i, end, key)
        return batch_id, spans
    except (IndexError, struct.error):
        raise FramingError("the message ends in the middle of a field") from None


def group_key(buf: bytes, start: int, end: int) -> tuple[int, str]:
    """(iteration, task id) of the group at ``buf[start:end]`` as far as they can be read, for the
    refusal of a group that ``read_group`` found unacceptable."""
    iteration, task_id, i = 0, "", start
    try:
        while i < end:
            key, i = _key(buf, i)
            if key == _G_ITERATION:
                iteration, i = _read_varint(buf, i)
            elif key == _G_TASK_ID:
                a, i = _read_len(buf, i, end)
                task_id = str(buf[a:i], "utf-8", "replace")
            else:
                i = _skip(buf, i, end, key)
    except (IndexError, struct.error, FramingError):
        pass
    return iteration, task_id


class WireGroup:
    """An accepted result as its worker sent it: the ``TrajectoryGroup`` message (fields 1-6, checked
    on arrival) as a slice of the bytes it came in, plus what the coordinator needs before a trainer
    reads it. The samples are decoded only when something asks for them (``samples``); the shard
    writer and ``FetchShard`` take ``wire`` as it is. Same attributes as ``GroupRecord``."""

    __slots__ = ("task_id", "node", "policy_version", "gen_seconds", "reward_seconds", "num_tokens", "num_bytes",
                 "_buf", "_start", "_end")

    def __init__(self, buf: bytes, start: int, end: int, *, task_id: str, node: str, policy_version: int,
                 gen_seconds: float, reward_seconds: float, num_tokens: int, num_bytes: int):
        self._buf, self._start, self._end = buf, start, end
        self.task_id, self.node, self.policy_version = task_id, node, policy_version
        self.gen_seconds, self.reward_seconds = gen_seconds, reward_seconds
        self.num_tokens, self.num_bytes = num_tokens, num_bytes

    @property
    def wire(self) -> memoryview:
        return memoryview(self._buf)[self._start:self._end]

    @property
    def samples(self) -> list[SampleRecord]:
        buf, out, i = self._buf, [], self._start
        while i < self._end:
            key, i = _key(buf, i)
            if key == _G_SAMPLE:
                a, i = _read_len(buf, i, self._end)
                f = _sample_fields(buf, a, i)
                out.append(SampleRecord(
                    bytes(buf[f[0]:f[1]]), bytes(buf[f[2]:f[3]]), f[4], str(buf[f[5]:f[6]], "utf-8"),
                    str(buf[f[7]:f[8]], "utf-8"), bytes(buf[f[9]:f[10]]), f[11] or 1, f[12], f[13],
                ))
            else:
                i = _skip(buf, i, self._end, key)
        return out

    def __repr__(self) -> str:
        return (f"WireGroup(task_id={self.task_id!r}, node={self.node!r}, policy_version={self.policy_version}, "
                f"num_tokens={self.num_tokens}, bytes={self._end - self._start})")


def _sample_fields(buf: bytes, i: int, end: int) -> tuple:
    """One ``Sample``: (ids start, ids end, logprobs start, end, reward, finish_reason start, end,
    text start, end, loss_mask start, end, turns, env_s, truncated, canonical). ``canonical``: no
    field twice, none unknown (otherwise the group is rebuilt from these values).

    The hot loop of a result batch (32 samples per 1 MiB batch in bench/scheduler.py): a LEN
    field's length (up to 3 bytes: 2 MiB) is decoded inline, the rest by ``_read_len``."""
    ids0 = ids1 = lps0 = lps1 = fr0 = fr1 = tx0 = tx1 = mk0 = mk1 = 0
    reward = env_s = 0.0
    turns, truncated, seen, canonical = 0, False, 0, True
    while i < end:
        key = buf[i]
        i += 1
        if key >= 0x80:
            key, i = _long_key(buf, i - 1)
            canonical = False
        bit = 1 << (key >> 3) if key < 0x80 else 0
        if seen & bit:
            canonical = False
        seen |= bit
        if key & 7 == 2 and (key == _IDS or key == _LPS or key == _REASON or key == _TEXT or key == _MASK):
            b = buf[i]
            if b < 0x80:
                a = i + 1
                z = a + b
            elif buf[i + 1] < 0x80:
                a = i + 2
                z = a + (b & 0x7F | buf[i + 1] << 7)
            elif buf[i + 2] < 0x80:
                a = i + 3
                z = a + (b & 0x7F | (buf[i + 1] & 0x7F) << 7 | buf[i + 2] << 14)
            else:
                a, z = _read_len(buf, i, end)
            if z > end:
                raise FramingError(f"a field of {z - a} bytes runs past the end of its message")
            i = z
            if key == _IDS:
                ids0, ids1 = a, z
            elif key == _LPS:
                lps0, lps1 = a, z
            elif key == _REASON:
                fr0, fr1 = a, z
            elif key == _TEXT:
                tx0, tx1 = a, z
            else:
                mk0, mk1 = a, z
        elif key == _REWARD:
            reward = _F32.unpack_from(buf, i)[0]
            i += 4
        elif key == _TURNS:
            turns, i = _read_varint(buf, i)
            turns &= 0xFFFFFFFF
        elif key == _ENV_S:
            env_s = _F32.unpack_from(buf, i)[0]
            i += 4
        elif key == _TRUNCATED:
            t, i = _read_varint(buf, i)
            truncated = t != 0
        else:
            i = _skip(buf, i, end, key)
            canonical = False
    if i != end:
        raise FramingError("a sample's last field runs past its end")
    return (ids0, ids1, lps0, lps1, reward, fr0, fr1, tx0, tx1, mk0, mk1, turns, env_s, truncated, canonical)


def read_group(field: str, buf: bytes, start: int, end: int, *, node: str = "") -> tuple[int, WireGroup]:
    """Check the ``TrajectoryGroup`` at ``buf[start:end]`` as ``convert.group_from_pb`` checks a
    message, and keep it as a ``WireGroup``: (iteration, group).

    Raises:
        InvalidRequestError: a field's value is not acceptable (its message names the field);
            refuse this group, keep the stream.
        FramingError: the bytes are not a well-formed message.
    """
    try:
        return _read_group(field, buf, start, end, node)
    except (IndexError, struct.error):
        raise FramingError(f"{field}: the message ends in the middle of a field") from None


def _read_group(field: str, buf: bytes, start: int, end: int, node: str) -> tuple[int, WireGroup]:
    iteration = policy_version = 0
    gen_seconds = reward_seconds = 0.0
    task = (0, 0)
    samples: list[tuple] = []
    seen, canonical = 0, True
    i = start
    while i < end:
        key = buf[i]
        i += 1
        if key >= 0x80:
            key, i = _long_key(buf, i - 1)
            canonical = False
        if key == _G_SAMPLE:
            a, i = _read_len(buf, i, end)
            samples.append(_sample_fields(buf, a, i))
            continue
        bit = 1 << (key >> 3) if key < 0x80 else 0
        if seen & bit:
            canonical = False
        seen |= bit
        if key == _G_ITERATION:
            iteration, i = _read_varint(buf, i)
        elif key == _G_TASK_ID:
            task = _read_len(buf, i, end)
            i = task[1]
        elif key == _G_POLICY_VERSION:
            policy_version, i = _read_varint(buf, i)
            if policy_version >= 1 << 63:
                policy_version -= 1 << 64
        elif key == _G_GEN_S:
            gen_seconds = _F64.unpack_from(buf, i)[0]
            i += 8
        elif key == _G_REWARD_S:
            reward_seconds = _F64.unpack_from(buf, i)[0]
            i += 8
        else:  # node, prompt_ids, split, metadata_json are the coordinator's to fill; others unknown
            i = _skip(buf, i, end, key)
            canonical = False
    if i != end:
        raise FramingError(f"{field}: the last field runs past the group's end")
    task_id = v.ident(f"{field}.task_id", _text(buf, task, f"{field}.task_id"), remember=False)
    tokens = nbytes = 0
    for j, f in enumerate(samples):
        ids_len, lps_len, reward, mask_len = f[1] - f[0], f[3] - f[2], f[4], f[10] - f[9]
        if ids_len % 4 or lps_len != ids_len:
            raise InvalidRequestError(
                f"{field}.samples[{j}]: completion_ids ({ids_len} bytes) must be int32 and "
                f"logprobs ({lps_len} bytes) one float32 per token"
            )
        if not math.isfinite(reward):
            raise InvalidRequestError(f"{field}.samples[{j}].reward: {reward!r} is not finite")
        if mask_len and (mask_len * 4 != ids_len or buf[f[9]:f[10]].strip(b"\x00\x01")):
            raise InvalidRequestError(
                f"{field}.samples[{j}].loss_mask: {mask_len} bytes for {ids_len // 4} tokens; "
                "it must be empty or one 0/1 byte per token"
            )
        env_s = f[12]
        if not math.isfinite(env_s) or env_s < 0:
            raise InvalidRequestError(f"{field}.samples[{j}].env_s: {env_s!r} must be a finite number >= 0")
        if f[6] > f[5] and not _utf8(buf, f[5], f[6]):  # the field's name is built only for an error
            _text(buf, (f[5], f[6]), f"{field}.samples[{j}].finish_reason")
        if f[8] > f[7] and not _utf8(buf, f[7], f[8]):
            _text(buf, (f[7], f[8]), f"{field}.samples[{j}].text")
        canonical &= f[14]
        tokens += ids_len // 4
        nbytes += ids_len + lps_len + mask_len + f[8] - f[7]
    if not samples:
        raise InvalidRequestError(f"{field}.samples: must not be empty")
    if not canonical:  # rebuilt with exactly the fields a worker fills, each once
        rebuilt = []
        for f in samples:
            sp: list = []
            size = _sample_parts(sp, buf[f[0]:f[1]], buf[f[2]:f[3]], f[4], buf[f[5]:f[6]], buf[f[7]:f[8]],
                                 buf[f[9]:f[10]], f[11], f[12], f[13])
            rebuilt.append((sp, size))
        parts: list = []
        _group_parts(parts, iteration, task_id.encode(), policy_version, gen_seconds, reward_seconds, rebuilt)
        buf = b"".join(parts)
        start, end = 0, len(buf)
    return iteration, WireGroup(
        buf, start, end, task_id=task_id, node=node, policy_version=policy_version, gen_seconds=gen_seconds,
        reward_seconds=reward_seconds, num_tokens=tokens, num_bytes=nbytes,
    )
