"""Framing: every frame is a 4-byte big-endian payload length followed by the payload. A
frame is at most :data:`MAX_FRAME_BYTES` of payload (:data:`MAX_REQUEST_BYTES` towards the
node agent); an empty or oversized one is a :class:`~kvshare.api.wire.errors.ProtocolError`
as soon as its header arrives."""

from __future__ import annotations

import struct

from kvshare.api.wire.errors import ProtocolError

__all__ = ["HEADER_BYTES", "MAX_FRAME_BYTES", "MAX_REQUEST_BYTES", "FrameReader", "encode_frame"]

#: Largest payload of one frame. Every real message is far smaller (admin replies, which
#: list every pool, have a limit of their own).
MAX_FRAME_BYTES = 256 * 1024
#: Largest payload of a frame sent *to* the node agent (pools, start-up turns, admin
#: requests): the largest real one, a hello with every name at its longest, is < 2 KiB.
MAX_REQUEST_BYTES = 16 * 1024

_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size


def encode_frame(payload: bytes, limit: int = MAX_FRAME_BYTES) -> bytes:
    """``payload`` behind its length header; refuses payloads over ``limit``."""
    if len(payload) > limit:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds {limit}", "frame")
    return _HEADER.pack(len(payload)) + payload


class FrameReader:
    """Splits a byte stream into frame payloads, enforcing the size limit.

    Feed it whatever ``recv`` returned; it returns every payload now complete and keeps
    the rest. An empty or oversized frame is a :class:`ProtocolError` as soon as its
    header arrives, before its payload is buffered.
    """

    __slots__ = ("_buffer", "_limit")

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; the payloads of the frames that are now complete, in order."""
        buffer = self._buffer
        buffer += data
        payloads = []
        offset = 0
        try:
            while len(buffer) - offset >= HEADER_BYTES:
                (length,) = _HEADER.unpack_from(buffer, offset)
                if length == 0 or length > self._limit:
                    raise ProtocolError(f"frame length {length} outside 1..{self._limit}", "frame")
                end = offset + HEADER_BYTES + length
                if len(buffer) < end:
                    break
                payloads.append(bytes(buffer[offset + HEADER_BYTES : end]))
                offset = end
        finally:
            del buffer[:offset]
        return payloads

    def pending(self) -> int:
        """Bytes received that do not yet form a complete frame."""
        return len(self._buffer)
