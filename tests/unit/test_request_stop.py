"""A worker's request that its torchrun agent stop instead of restarting it
(``rendezvous.worker.request_stop`` / ``take_stop_request``, ``elasticrl.node.stop_node``)."""

from __future__ import annotations

import logging

from elasticrl.node import stop_node
from elasticrl.rendezvous.worker import STOP_FILE_ENV, request_stop, take_stop_request


def test_a_request_reaches_the_agent_once_with_its_reason(tmp_path, monkeypatch):
    path = tmp_path / "agent.stop"
    monkeypatch.setenv(STOP_FILE_ENV, str(path))
    assert take_stop_request(str(path)) is None  # nobody asked
    assert request_stop("node-1: ValueError: bad") == str(path)
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed into place
    assert take_stop_request(str(path)) == "node-1: ValueError: bad"
    assert take_stop_request(str(path)) is None  # taken: a later rendezvous is not stopped by it
    request_stop("   ")
    assert take_stop_request(str(path)) == "no reason given"


def test_without_an_elasticrl_agent_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(STOP_FILE_ENV, raising=False)
    assert request_stop("x") is None


def test_stop_node_names_the_node_rank_and_error(tmp_path, monkeypatch, caplog):
    path = tmp_path / "agent.stop"
    monkeypatch.setenv(STOP_FILE_ENV, str(path))
    with caplog.at_level(logging.ERROR, logger="elasticrl.node"):
        stop_node(KeyError("no such answer field"), "node-3", 5)
    assert take_stop_request(str(path)) == "node-3 rank 5: KeyError: 'no such answer field'"
    assert "asked this node's torchrun agent to stop" in caplog.text
    monkeypatch.setenv(STOP_FILE_ENV, str(tmp_path / "missing-dir" / "agent.stop"))
    with caplog.at_level(logging.WARNING, logger="elasticrl.node"):
        stop_node(ValueError("v"), "node-3", 5)  # an unwritable path is logged, never raised
    assert "could not ask the torchrun agent to stop" in caplog.text
    monkeypatch.delenv(STOP_FILE_ENV)
    with caplog.at_level(logging.WARNING, logger="elasticrl.node"):
        stop_node(ValueError("v"), "node-3", 5)
    assert "no elasticrl torchrun agent to ask" in caplog.text
