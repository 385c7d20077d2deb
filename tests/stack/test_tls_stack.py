"""Mutual TLS between the services as real processes (`serve --tls-cert --tls-key --tls-ca`); the
certificates come from conftest.py's `certificates`. TLS in process: tests/test_tls.py."""

from __future__ import annotations

import httpx
import pytest

from pagedserve.common.grpc_util import TLS_ENV, check_health, internal_channel
from pagedserve.v1 import scheduler_pb2, scheduler_pb2_grpc


@pytest.mark.slow
def test_the_services_talk_tls_among_themselves(certificates, tiny_model, launch_stack):
    """`serve --tls-cert --tls-key --tls-ca`: every internal hop is mutual TLS; the public API is
    unchanged; a plain-TCP client of the scheduler gets nothing."""
    ours = certificates["ours"]
    stack = launch_stack(tiny_model, "tls-logs", tls_cert=ours[TLS_ENV["cert"]], tls_key=ours[TLS_ENV["key"]],
                         tls_ca=ours[TLS_ENV["ca"]])
    reply = httpx.post(stack.addresses["http"] + "/v1/completions", timeout=60,
                       json={"model": httpx.get(stack.addresses["http"] + "/v1/models").json()["data"][0]["id"],
                             "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    scheduler = stack.addresses["scheduler"]
    assert not check_health(scheduler, environ={}, timeout_s=2)
    with internal_channel(scheduler, environ=ours) as channel:
        stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.StatsRequest(), timeout=10)
    assert stats.ready
