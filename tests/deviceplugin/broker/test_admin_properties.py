"""Properties of the admin protocol over generated requests: any request the admin codec
lets through is executed or refused in words, never half-applied; the books stay
consistent; every reply travels back exactly."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.api.wire import Hello, ProtocolError, Report
from kvshare.deviceplugin.broker.books import Books
from kvshare.deviceplugin.broker.connections.admin_requests import (
    ADMIN_CODEC,
    OPS,
    AdminReply,
    AdminRequest,
    execute,
)
from kvshare.deviceplugin.inventory import GpuInfo
from tests.api.test_wire_properties import ANY_INT, ANY_TEXT, any_json

GIB = 2**30
PAGE = 2 * 2**20
GPUS = [GpuInfo(uuid=f"GPU-test-{i}", index=i, name="test", total_bytes=16 * GIB) for i in (0, 1)]


def books_with_pools() -> Books:
    books = Books(GPUS, headroom=GIB)
    for pid, (gpu, pod) in enumerate([(0, "a"), (0, "b"), (1, "a")], start=10):
        hello = Hello(version=1, gpu=GPUS[gpu].uuid, page_size=PAGE, kv_min=GIB, kv_max=None,
                      priority=100, static=GIB, namespace="ns", pod=pod)  # fmt: skip
        record = books.admit(hello, pid, 0.0).record
        assert record is not None
        books.want(record.id, 1, 4 * GIB, 0.0)
        books.report(record.id, Report(mapped=2 * GIB, used=GIB, cached=0, reserved=0), 0.0)
    return books


SELECTORS = st.sampled_from(["1", "2", "3", "ns/a", "ns/b", "0", "GPU-test-1", "²", "9" * 400])
REQUESTS = st.builds(
    AdminRequest,
    op=st.sampled_from(OPS) | ANY_TEXT,
    pool=SELECTORS | ANY_TEXT,
    gpu=SELECTORS | ANY_TEXT,
    size=st.none() | ANY_INT.filter(lambda n: -(2**63) <= n < 2**63),
)
PROPERTIES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run(books: Books, request: AdminRequest) -> AdminReply:
    """Execute ``request`` as the broker would; check what must hold whatever it was."""
    before = books.view(1.0)
    reply, sends = execute(books, request, 1.0)
    books.check()
    pools = {p.id for p in books.pools()}
    assert all(send.to == "pool" and send.key in pools for send in sends)
    if not reply.ok:
        assert reply.error and books.view(1.0) == before and not sends
    assert ADMIN_CODEC.decode(ADMIN_CODEC.encode(reply)[4:]) == reply
    return reply


@PROPERTIES
@given(st.lists(REQUESTS, min_size=1, max_size=6))
def test_any_sequence_of_admin_requests_keeps_the_books_consistent(
    requests: list[AdminRequest],
) -> None:
    books = books_with_pools()
    for request in requests:
        run(books, request)


@PROPERTIES
@given(st.dictionaries(st.sampled_from(["op", "pool", "gpu", "size"]) | ANY_TEXT, any_json()))
def test_any_admin_frame_is_executed_within_the_rules_or_refused(body: dict[str, object]) -> None:
    payload = json.dumps({"type": "admin-request", **body}).encode()
    try:
        request = ADMIN_CODEC.decode_as(payload, AdminRequest)
    except ProtocolError:
        return
    run(books_with_pools(), request)
