"""The broker's wire protocol: frames, strict decoding, and what a peer may not send."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest

from kvshare.api.wire import (
    BROKER_CODEC,
    MAX_FRAME_BYTES,
    Bye,
    FrameReader,
    Hello,
    Lease,
    ProtocolError,
    Reclaim,
    Refused,
    Report,
    TurnDone,
    TurnGranted,
    TurnRefused,
    TurnRequest,
    Want,
    Welcome,
    encode_frame,
)

HELLO = Hello(version=1, gpu="GPU-1", page_size=2 * 2**20, kv_min=2**30, kv_max=None,
              priority=200, static=2**33, namespace="llm", pod="qwen-0", resume=True,
              held=5, used=4, lease=6)  # fmt: skip
MESSAGES = [
    HELLO,
    Want(seq=1, total=2**31),
    Report(mapped=4, used=3, cached=1, reserved=2, ack=7),
    Bye(),
    Welcome(pool_id=3, name="llm/qwen-0", lease=2**30, kv_max=None),
    Refused(reason="fit: no room"),
    Lease(seq=1, limit=2**31, reason="granted"),
    Reclaim(seq=9, limit=2**30, deadline_s=10.0, reason="contention"),
    TurnRequest(
        seq=1,
        gpu="GPU-1",
        static=2**33,
        kv_min=2**30,
        pod_uid="0f8fad5b-d9cb-469f-a165-70867728950e",
        rank=1,
    ),
    TurnGranted(seq=1, hold_s=600.0),
    TurnRefused(seq=1, reason="draining"),
    TurnDone(seq=1),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.TYPE)
def test_every_message_survives_a_round_trip(message: object) -> None:
    frame = BROKER_CODEC.encode(message)  # type: ignore[arg-type]
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert BROKER_CODEC.decode(frame[4:]) == message


def test_frames_are_split_whatever_the_recv_boundaries() -> None:
    stream = b"".join(BROKER_CODEC.encode(m) for m in MESSAGES)
    reader = FrameReader()
    decoded = []
    for i in range(0, len(stream), 7):  # 7-byte pieces cut headers and payloads apart
        decoded += [BROKER_CODEC.decode(p) for p in reader.feed(stream[i : i + 7])]
    assert decoded == MESSAGES and reader.pending() == 0


def payload(**fields: object) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"not json", "not a JSON object"),
        (b"[1]", "not a JSON object"),
        (payload(type="grant-everything"), "unknown message type 'grant-everything'"),
        (payload(seq=1, total=2), "the message has no type"),
        (payload(type="want", seq=1), "missing fields ['total']"),
        (payload(type="want", seq=1, total=2, pool_id=3), "unknown fields ['pool_id']"),
        (payload(type="want", seq="1", total=2), "Want.seq: expected an integer"),
        (payload(type="want", seq=True, total=2), "Want.seq: expected an integer"),
        (payload(type="report", mapped=1.5, used=0, cached=0, reserved=0), "expected an integer"),
        (payload(**{**dataclasses.asdict(HELLO), "type": "hello", "resume": 1}), "true or false"),
        (b"\xff\xfe", "not a JSON object"),
        (json.dumps({"type": "bye"}).encode("utf-16"), "can't decode"),  # UTF-8 only
    ],
)
def test_anything_else_is_a_protocol_error(raw: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError) as info:
        BROKER_CODEC.decode(raw)
    assert fragment in str(info.value)


def test_oversized_and_empty_frames_are_refused_before_their_payload() -> None:
    with pytest.raises(ProtocolError, match=r"outside 1\.\."):
        FrameReader().feed(struct.pack(">I", MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match=r"outside 1\.\."):
        FrameReader().feed(struct.pack(">I", 0))
    with pytest.raises(ProtocolError, match="exceeds"):
        encode_frame(b"x" * (MAX_FRAME_BYTES + 1))


def test_a_codec_decodes_only_its_own_messages() -> None:
    with pytest.raises(ProtocolError, match="expected 'welcome', got 'lease'"):
        BROKER_CODEC.decode_as(BROKER_CODEC.encode(MESSAGES[6])[4:], Welcome)
