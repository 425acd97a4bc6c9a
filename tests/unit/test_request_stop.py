"""A worker's request that its torchrun agent stop instead of restarting it
(``rendezvous.worker.request_stop`` / ``take_stop_request``, ``elasticrl.node.stop_node``)."""

from __future__ import annotations

import logging

from elasticrl.node import stop_node
from elasticrl.rendezvous.worker import STOP_FILE_ENV, StopRequest, request_stop, take_stop_request


def test_a_request_reaches_the_agent_once_with_its_reason(tmp_path, monkeypatch):
    path = tmp_path / "agent.stop"
    monkeypatch.setenv(STOP_FILE_ENV, str(path))
    assert take_stop_request(str(path)) is None  # nobody asked
    assert request_stop("ValueError", "node-1: ValueError: bad", at_once=True) == str(path)
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed into place
    assert take_stop_request(str(path)) == StopRequest("ValueError", "node-1: ValueError: bad", True)
    assert take_stop_request(str(path)) is None  # taken: a later rendezvous is not stopped by it
    request_stop("EnvError", "   ", at_once=False)
    assert take_stop_request(str(path)) == StopRequest("EnvError", "no reason given", False)
    path.write_text("not json")  # what cannot be read restarts the workers as usual
    assert take_stop_request(str(path)) is None and not path.exists()


def test_without_an_elasticrl_agent_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(STOP_FILE_ENV, raising=False)
    assert request_stop("ValueError", "x", at_once=True) is None


def test_stop_node_names_the_node_rank_and_error(tmp_path, monkeypatch, caplog):
    path = tmp_path / "agent.stop"
    monkeypatch.setenv(STOP_FILE_ENV, str(path))
    with caplog.at_level(logging.ERROR, logger="elasticrl.node"):
        stop_node(KeyError("no such answer field"), "node-3", 5, at_once=False)
    assert take_stop_request(str(path)) == StopRequest("KeyError", "node-3 rank 5: KeyError: 'no such answer field'", False)
    assert "asked this node's torchrun agent not to restart" in caplog.text
    monkeypatch.setenv(STOP_FILE_ENV, str(tmp_path / "missing-dir" / "agent.stop"))
    with caplog.at_level(logging.WARNING, logger="elasticrl.node"):
        stop_node(ValueError("v"), "node-3", 5, at_once=True)  # an unwritable path is logged, never raised
    assert "could not ask the torchrun agent to stop" in caplog.text
    monkeypatch.delenv(STOP_FILE_ENV)
    with caplog.at_level(logging.WARNING, logger="elasticrl.node"):
        stop_node(ValueError("v"), "node-3", 5, at_once=True)
    assert "no elasticrl torchrun agent to ask" in caplog.text


def test_a_config_that_does_not_parse_stops_the_node_at_once(tmp_path, monkeypatch, capsys):
    """Caught before torch is imported (``elasticrl.node.parse``): a restart would fail the same way."""
    import pytest

    from elasticrl.node import parse

    path = tmp_path / "agent.stop"
    monkeypatch.setenv(STOP_FILE_ENV, str(path))
    with pytest.raises(SystemExit) as exc:
        parse(["--run.iterations=abc"])
    assert exc.value.code == 2 and "run.iterations" in capsys.readouterr().err
    stop = take_stop_request(str(path))
    assert stop.at_once and stop.kind == "ConfigError" and "run.iterations" in stop.reason
    with pytest.raises(SystemExit):
        parse(["--print-config", "--run.iterations=abc"])  # only printing: nobody to stop
    assert not path.exists()
