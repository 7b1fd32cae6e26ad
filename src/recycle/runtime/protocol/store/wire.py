"""The job store's wire format: length-prefixed frames, a handshake in which both ends prove that they know the job
token (HMAC challenge-response, the token itself never crosses the wire), and a MAC with a sequence number on every
frame after it (keyed BLAKE2b, with a per-session, per-direction key), so a frame altered, replayed, reordered or
injected on the way is refused. Nothing is pickled: a request is an op byte and a list of length-prefixed byte
strings."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["MAGIC", "MAGIC_FAMILY", "NONCE_BYTES", "MAC_BYTES", "MAX_FRAME_BYTES", "MAX_HANDSHAKE_BYTES",
           "MAX_KEY_BYTES", "MAX_IDENTITY_BYTES", "Op", "Status", "WireError", "token_key", "new_nonce", "client_proof",
           "server_proof", "Session", "pack_fields", "unpack_fields", "encode_frame", "FrameReader",
           "pack_handshake", "unpack_handshake", "AUTH_FAILED"]

MAGIC = b"RCYSTORE2"  # the server's hello starts with it: a client that reaches something else says so
MAGIC_FAMILY = MAGIC[:-1]  # ... and one that reaches another version's store (its last byte) says that
NONCE_BYTES = 32
MAC_BYTES = 16  # a frame's tag: 128-bit keyed BLAKE2b, against forgery of a frame
MAX_FRAME_BYTES = 1 << 28  # 256 MiB: a plan for thousands of workers is tens of MB; beyond this, refuse
MAX_HANDSHAKE_BYTES = 1024  # an unauthenticated peer may not make the server buffer more than this
MAX_KEY_BYTES = 4096
MAX_IDENTITY_BYTES = 256
MAX_FIELDS = 1 << 20
AUTH_FAILED = b"AUTH-FAILED"  # the server's answer to a wrong proof: it carries no information about the token
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


class WireError(Exception):
    """A frame that breaks the protocol (too large, malformed, or with a wrong MAC): the connection is dropped."""


class Op(IntEnum):
    SET = 1
    GET = 2  # fields: key, timeout_ms (0: do not wait)
    ADD = 3
    CHECK = 4
    WAIT = 5  # fields: timeout_ms, keys...: every key exists
    WAIT_ANY = 6  # fields: timeout_ms, keys...: answer with the index of the first key that exists
    COMPARE_SET = 7
    DELETE = 8
    NUM_KEYS = 9
    MULTI_GET = 10  # fields: timeout_ms, keys...
    MULTI_SET = 11
    APPEND = 12
    PING = 13
    CANCEL = 14  # no fields, sent while a wait of the connection is in progress: it ends now (TIMEOUT, unless it
    # had already been answered), and then the cancel is answered (OK), in that order
    WAIT_ANY_BEAT = 15  # fields: beat_key, timeout_ms, keys...: adds 1 to beat_key (a node launcher's heartbeat),
    # then as WAIT_ANY: a launcher beats and waits once per heartbeat interval, one request for both


class Status(IntEnum):
    OK = 0
    NOT_FOUND = 1
    TIMEOUT = 2
    FENCED = 3  # the coordinator fenced this process: it must stop
    BAD_REQUEST = 4


def token_key(token: str) -> bytes:
    """The MAC key of a job: derived from its token, so the token is never used raw."""
    return hashlib.sha256(b"recycle job store v1\0" + token.encode()).digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"".join(parts), "sha256")  # (one C call: every request and reply pays it twice)


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes, identity: bytes) -> bytes:
    return _mac(key, b"client\0", server_nonce, client_nonce, identity)


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes, identity: bytes) -> bytes:
    return _mac(key, b"server\0", client_nonce, server_nonce, identity)


def _frame_mac(key: bytes) -> hashlib.blake2b:
    """A keyed BLAKE2b (RFC 7693's MAC mode) whose copies tag frames: the key is set up once per session and
    direction, and a frame costs one copy, not a key schedule (HMAC-SHA256 through OpenSSL 3 took 4 us a call here,
    twice per request, a fifth of the job store's thread at 16,384 ranks; this takes 0.9 us)."""
    return hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=b"recycle frame")


def _tag(keyed: hashlib.blake2b, seq: int, payload: bytes) -> bytes:
    """Frame number `seq`'s tag: a copy of the session's keyed BLAKE2b over the number and the payload."""
    mac = keyed.copy()
    mac.update(_SEQ.pack(seq))
    mac.update(payload)
    return mac.digest()


class Session:
    """The MAC state of one authenticated connection, seen from one end (`client` says which)."""

    def __init__(self, key: bytes, server_nonce: bytes, client_nonce: bytes, client: bool) -> None:
        session = _mac(key, b"session\0", server_nonce, client_nonce)
        to_server, to_client = _mac(session, b"c2s"), _mac(session, b"s2c")
        send_key, recv_key = (to_server, to_client) if client else (to_client, to_server)
        self._send_mac, self._recv_mac = _frame_mac(send_key), _frame_mac(recv_key)
        self._send_seq = 0
        self._recv_seq = 0

    def seal(self, payload: bytes) -> bytes:
        tag = _tag(self._send_mac, self._send_seq, payload)
        self._send_seq += 1
        return payload + tag

    def seal_frames(self, payloads: list[bytes]) -> bytes:
        """encode_frame(seal(p)) of each of `payloads`, in order, as one byte string (a pipelined batch of requests:
        one call, not three per request)."""
        first, length = self._send_seq, _LEN.pack
        if any(len(p) + MAC_BYTES > MAX_FRAME_BYTES for p in payloads):
            raise WireError(f"a message over {MAX_FRAME_BYTES:,} bytes; the store takes at most that")
        keyed = self._send_mac
        self._send_seq += len(payloads)
        return b"".join([part for seq, payload in enumerate(payloads, first) for part in (
            length(len(payload) + MAC_BYTES), payload, _tag(keyed, seq, payload))])

    def open(self, frame: bytes) -> bytes:
        if len(frame) < MAC_BYTES + 1:
            raise WireError("a frame too short to carry a MAC")
        payload, tag = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
        expected = _tag(self._recv_mac, self._recv_seq, payload)
        if not hmac.compare_digest(tag, expected):
            raise WireError("a frame with a wrong MAC (altered, replayed or not from this session)")
        self._recv_seq += 1
        return payload


def pack_fields(head: int, fields: tuple[bytes, ...] | list[bytes]) -> bytes:
    """An op (request) or status (reply) byte followed by length-prefixed fields."""
    parts = [bytes((head,))]
    for field in fields:
        parts.append(_LEN.pack(len(field)))
        parts.append(field)
    return b"".join(parts)


def unpack_fields(payload: bytes) -> tuple[int, list[bytes]]:
    if not payload:
        raise WireError("an empty message")
    fields: list[bytes] = []
    head, offset, size = payload[0], 1, len(payload)
    while offset < size:
        if offset + 4 > size or len(fields) >= MAX_FIELDS:
            raise WireError("a truncated field")
        (length,) = _LEN.unpack_from(payload, offset)
        offset += 4
        if offset + length > size:
            raise WireError("a field longer than its message")
        fields.append(payload[offset:offset + length])
        offset += length
    return head, fields


def encode_frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise WireError(f"a message of {len(payload):,} bytes; the store takes at most {MAX_FRAME_BYTES:,}")
    return _LEN.pack(len(payload)) + payload


@dataclass
class FrameReader:
    """Cuts a byte stream into frames, refusing any frame longer than `limit` before buffering it."""

    limit: int
    buffer: bytearray

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.buffer += data
        frames = []
        while len(self.buffer) >= 4:
            (length,) = _LEN.unpack_from(self.buffer, 0)
            if length > self.limit:
                raise WireError(f"a frame of {length:,} bytes announced; the limit here is {self.limit:,}")
            if len(self.buffer) < 4 + length:
                break
            frames.append(bytes(self.buffer[4:4 + length]))
            del self.buffer[:4 + length]
        if len(self.buffer) > self.limit + 4:
            raise WireError("more buffered bytes than one frame may hold")
        return frames


def pack_handshake(client_nonce: bytes, identity: bytes, proof: bytes) -> bytes:
    return pack_fields(0, (client_nonce, identity, proof))


def unpack_handshake(payload: bytes) -> tuple[bytes, bytes, bytes]:
    _, fields = unpack_fields(payload)
    if len(fields) != 3 or len(fields[0]) != NONCE_BYTES or len(fields[1]) > MAX_IDENTITY_BYTES:
        raise WireError("a malformed handshake")
    return fields[0], fields[1], fields[2]
