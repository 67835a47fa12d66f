"""What a trainer catches: the service's refusals arrive as one class per kind (lastgood.errors),
from the REST calls (RestClient's methods) as from the gRPC data path, and the client's
settings come from one resolved ClientConfig."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lastgood
from lastgood.remote.rest import RestClient


def test_refusals_arrive_as_their_class(service, run_name):
    torch.manual_seed(0)
    state = lastgood.TrainState(model=nn.Linear(4, 4))
    first = lastgood.Checkpointer(service.url, run=run_name, attempt="first-launch")
    first.save(1, state)
    first.wait()
    cid = first.last_saved.checkpoint_id

    with pytest.raises(lastgood.NotFound) as missing:  # a REST refusal
        first.tag("best", checkpoint_id=10**9)
    e = missing.value
    assert (e.status, e.reason, e.coded) == (404, "not_found", True) and e.detail in str(e) and e.detail
    with pytest.raises(lastgood.InvalidArgument):
        first.tag("x" * 10_000, checkpoint_id=cid)
    with pytest.raises(lastgood.Conflict):  # a gRPC refusal: another world size for a begun step
        first.transport.begin(run_name, 1, 2, None, first.attempt, 0)

    second = lastgood.Checkpointer(service.url, run=run_name, attempt="second-launch")
    with pytest.raises(lastgood.Fenced) as fenced:  # REST: a fenced launch's tag
        first.tag("best", checkpoint_id=cid)
    assert isinstance(fenced.value, lastgood.Refused) and fenced.value.status == 409
    with pytest.raises(lastgood.Fenced) as fenced:  # gRPC: a fenced launch's begin
        first.transport.begin(run_name, 2, 1, cid, first.attempt, 0)
    assert fenced.value.grpc_code == "FAILED_PRECONDITION" and fenced.value.reason == lastgood.wire.codes.FENCED
    assert second.tag("best", checkpoint_id=cid)["checkpoint_id"] == cid  # control: the new launch may
    first.transport.close()
    second.close()


def test_a_run_without_checkpoints_reads_as_none_and_a_wrong_url_never(service, run_name):
    rest = RestClient(service.url)
    assert rest.last_good(run_name) is None  # the service said so: not_found
    with pytest.raises(lastgood.NotFound):
        rest.last_good(run_name, required=True)
    # a URL that is not the service's API answers 404 without a code: never "no checkpoint",
    # which would start the training over
    with pytest.raises(lastgood.NotFound) as wrong:
        RestClient(service.url + "/not-the-api").last_good(run_name)
    assert not wrong.value.coded


def test_the_spool_switch_is_read_once_with_the_services_words(service, run_name, monkeypatch):
    """LASTGOOD_USE_SPOOL=false, in the words the service's switches take, turns the
    client's hand-over off."""
    monkeypatch.setenv("LASTGOOD_USE_SPOOL", "false")
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.config.spool is False and ckpt.transport.spool is None
    monkeypatch.delenv("LASTGOOD_USE_SPOOL")
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:  # control: the service's host sees it
        assert ckpt.config.spool is True and ckpt.transport.spool is not None


def _broken_http_server(reply: bytes):
    """A socket that answers every connection with `reply` and hangs up: what a service dying
    mid-answer, or a broken proxy, looks like to the client. Not a lastgood service."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("reply", [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"a\":",  # cut short
                                   b"hello, not http\r\n\r\n"])                            # no status line
def test_a_broken_answer_is_unreachable_and_retried(reply, caplog):
    """http.client raises IncompleteRead / BadStatusLine, which are not OSErrors: they must
    become ServiceUnreachable (transient, retried), never escape the error model raw."""
    from lastgood.errors import ServiceUnreachable
    from lastgood.remote.rest import RestClient
    from lastgood.remote.retry import RetryPolicy, is_transient

    srv, url = _broken_http_server(reply)
    try:
        with pytest.raises(ServiceUnreachable) as once:
            RestClient(url, timeout=5).get_json("/api/v1/info")
        assert is_transient(once.value)
        policy = RetryPolicy(deadline=1.0, initial=0.05, max_delay=0.1)
        with caplog.at_level("WARNING", logger="lastgood"):
            with pytest.raises(ServiceUnreachable):  # retried until the deadline, then the last failure
                RestClient(url, timeout=5, retry=policy).runs()
        assert "gave up after" in caplog.text  # it was retried, not raised at the first try
    finally:
        srv.close()
