"""The bundled ``search`` env: BM25 ranking, the HTTP API, scripted episodes, question choice,
malformed rows, shared and external servers, and observations a character-level tokenizer can encode."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from elasticrl.env import _textgen, load_env
from elasticrl.env.base import call_reset, call_step
from elasticrl.env.search import BM25Index, SearchEnv, build_corpus, main, make_rows, serve

pytestmark = pytest.mark.timeout(60)

ALLOWED = set("abcdefghijklmnopqrstuvwxyz0123456789 \n.,:;!?()[]<>/=-'_\"")
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture
def env():
    search = SearchEnv()
    yield search
    search.close()


@pytest.fixture
def external_server():
    server, thread = serve(port=0, corpus_seed=0, docs=30)
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def get_json(url: str) -> tuple[int, dict]:
    try:
        with NO_PROXY.open(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def assert_encodable(obs: str) -> None:
    assert set(obs) <= ALLOWED, f"characters {set(obs) - ALLOWED} in {obs!r}"
    assert len(obs) < 500, obs


def test_bm25_ranks_the_exact_term_document_first():
    docs = ["the cat sat on the mat.", "a dog ran far away from home.", "dogs and cats play.", "zorbin was born in tarsin."]
    index = BM25Index(docs)
    assert index.search("dog", 3)[0][0] == 1
    assert index.search("where was zorbin born", 2)[0][0] == 3
    assert index.search("of the", 3) == []  # only stop words: nothing matches
    assert index.search("unknownword", 3) == []
    # Length normalization (b=0.75): the same single match ranks a shorter document higher.
    short_first = BM25Index(["tarsin has 7 bridges.", "the glimmerfox lives near tarsin with many other animals."])
    assert [doc for doc, _ in short_first.search("tarsin", 2)] == [0, 1]
    assert all(score > 0 for _, score in index.search("cat dog", 4))


def test_http_api(external_server):
    status, body = get_json(external_server + "/healthz")
    assert status == 200 and body["corpus_seed"] == 0 and body["docs"] == 30
    status, body = get_json(external_server + "/search?q=capital&k=3")
    assert status == 200 and len(body["results"]) == 2  # two countries, two capital sentences
    assert all({"id", "text"} <= set(hit) and "capital" in hit["text"] for hit in body["results"])
    assert get_json(external_server + "/search?q=capital&k=0")[0] == 400
    assert get_json(external_server + "/search?q=capital&k=x")[0] == 400
    assert get_json(external_server + "/nothing")[0] == 404


def test_scripted_episodes_search_then_answer(env):
    for instance in range(8):
        obs, info = env.reset(seed=instance, options={"instance": instance})
        question = env.question
        assert obs == f"question: {question.text}\nuse <search>query</search> to search and <answer>text</answer> to answer."
        obs, reward, terminated, truncated, info = env.step(f"let me look. <search>{question.text}</search>")
        assert (reward, terminated, truncated) == (0.0, False, False)
        assert obs.startswith("<information>(1) ") and obs.endswith("</information>") and question.answer in obs
        assert info["valid_action"] and info["num_results"] == 2 and info["query"] == question.text
        obs, reward, terminated, truncated, info = env.step(f"<answer>{question.answer}</answer>")
        assert (reward, terminated, truncated) == (1.0, True, False) and info["correct"]


def test_wrong_answer_scores_zero_and_the_first_tag_decides(env):
    env.reset(seed=0, options={"instance": 1})
    answer = env.question.answer
    _, reward, terminated, _, info = env.step(f"<search>{env.question.entity}</search> <answer>{answer}</answer>")
    assert (reward, terminated) == (0.0, False) and "query" in info
    _, reward, terminated, _, info = env.step(f"<answer>not {answer}</answer><search>x</search>")
    assert (reward, terminated, info["correct"]) == (0.0, True, False)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<answer>x</answer>")


def test_invalid_actions_explain_the_format(env):
    env.reset(seed=0)
    for action in ("hello", "", "search: zorbin", "<search></search>", "<search>   </search>"):
        obs, reward, terminated, truncated, info = env.step(action)
        assert (reward, terminated, truncated, info["valid_action"]) == (0.0, False, False, False), action
        assert "<search>query</search>" in obs and "<answer>text</answer>" in obs and len(obs) < 100
    # An unclosed tag runs to the end of the action.
    obs, _, _, _, info = env.step("<SEARCH>capital")
    assert info["valid_action"] and info["query"] == "capital" and "capital" in obs


def test_instance_picks_the_question_whatever_the_seed(env):
    asked = {env.reset(seed=seed, options={"instance": 4})[0] for seed in range(8)}
    assert len(asked) == 1 and env.question == env.questions[4]
    env.reset(seed=0, options={"instance": 4 + len(env.questions)})
    assert env.question == env.questions[4]
    assert len({env.reset(seed=seed)[1]["question"] for seed in range(20)}) > 1


def test_explicit_rows_and_answer_normalization(env):
    obs, _ = env.reset(options={"question": "who  painted the mat?", "answer": "Zorbin"})
    assert obs.startswith("question: who painted the mat?\n")
    _, reward, terminated, _, _ = env.step('<answer>  "ZORBIN."  </answer>')
    assert (reward, terminated) == (1.0, True)


@pytest.mark.parametrize(
    "row,field",
    [
        ({"question": None, "answer": "x"}, "question"),
        ({"question": "q?"}, "answer"),
        ({"question": "q?", "answer": 7}, "answer"),
        ({"instance": 1.5}, "instance"),
    ],
)
def test_malformed_rows_name_the_field(env, row, field):
    with pytest.raises(ValueError, match=rf"options\['{field}'\]"):
        env.reset(seed=0, options=row)


def test_make_rows_are_answerable_by_searching():
    rows = make_rows(60, corpus_seed=2)
    assert len(rows) == 60 and all(set(row) == {"question", "answer"} for row in rows)
    texts, questions = build_corpus(2, 30)
    env = SearchEnv(corpus_seed=2, top_k=20)
    try:
        assert [row["question"] for row in rows[:5]] == [q.text for q in questions[:5]]
        for row, question in zip(rows, questions):
            env.reset(options=row)
            assert any(row["answer"] in hit["text"] for hit in env.search(row["question"], 2)), row
            # The entity's name alone finds it too, among more results (a city is mentioned often).
            assert any(question.source == hit["text"] for hit in env.search(question.entity)), question
    finally:
        env.close()


def test_observations_are_short_and_use_only_the_allowed_characters():
    env = SearchEnv(corpus_seed=1, docs=60, top_k=3)
    try:
        for seed in range(10):
            obs, _ = env.reset(seed=seed)
            assert_encodable(obs)
            for action in (f"<search>{env.question.text}</search>", f"<search>{env.question.entity}</search>", "<search>the capital born lives</search>", "bad"):
                obs, *_ = env.step(action)
                assert_encodable(obs)
    finally:
        env.close()


def test_instances_share_one_server_which_stops_after_the_last_close():
    key = ("search", 9, 30)
    envs = [SearchEnv(corpus_seed=9) for _ in range(3)]
    assert _textgen.SERVERS.users(key) == 0
    for i, search in enumerate(envs):
        search.reset(seed=i)
    urls = {search.base_url for search in envs}
    assert len(urls) == 1 and _textgen.SERVERS.users(key) == 3
    port = int(urls.pop().rsplit(":", 1)[1])
    for search in envs:
        search.close()
        search.close()
    assert _textgen.SERVERS.users(key) == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    # A closed instance starts over on its next reset.
    envs[0].reset(seed=0)
    assert _textgen.SERVERS.users(key) == 1
    envs[0].close()


def test_concurrent_episodes_on_separate_instances():
    envs = [SearchEnv(corpus_seed=3) for _ in range(8)]

    def episode(i: int) -> float:
        search = envs[i]
        search.reset(seed=i, options={"instance": i})
        search.step(f"<search>{search.question.text}</search>")
        return search.step(f"<answer>{search.question.answer}</answer>")[1]

    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            assert list(pool.map(episode, range(8), timeout=30)) == [1.0] * 8
    finally:
        for search in envs:
            search.close()


def test_an_external_server_is_used_and_not_stopped(external_server):
    env = SearchEnv(server_url=external_server + "/")
    try:
        env.reset(seed=0, options={"instance": 0})
        assert env.base_url == external_server and _textgen.SERVERS.users(("search", 0, 30)) == 0
        obs, *_ = env.step(f"<search>{env.question.text}</search>")
        assert env.question.answer in obs
    finally:
        env.close()
        env.close()
    assert get_json(external_server + "/healthz")[0] == 200
    mismatched = SearchEnv(corpus_seed=1, server_url=external_server)
    with pytest.raises(_textgen.ContentServerError, match="corpus_seed=0 docs=30.*corpus_seed=1"):
        mismatched.reset(seed=0)
    mismatched.close()


def test_an_unreachable_server_fails_the_episode_quickly():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = SearchEnv(server_url=f"http://127.0.0.1:{port}", http_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(_textgen.ContentServerError, match=f"127.0.0.1:{port}/healthz"):
        env.reset(seed=0)
    assert time.monotonic() - started < 5
    env.close()


def test_bad_kwargs_say_how_to_fix_them():
    with pytest.raises(ValueError, match="top_k"):
        SearchEnv(top_k=0)
    with pytest.raises(ValueError, match="server_url"):
        SearchEnv(server_url="localhost:8000")
    with pytest.raises(ValueError, match="docs"):
        SearchEnv(docs=0)


def test_standalone_server_cli_help(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "--port" in capsys.readouterr().out


def test_loads_by_name_and_passes_the_runner_checks():
    search = load_env("search", {"top_k": 3}).make()
    try:
        obs, info = asyncio.run(call_reset(search, seed=1, options={"instance": 0}))
        assert obs.startswith("question: ") and info["question"] == search.question.text
        obs, reward, terminated, truncated, info = asyncio.run(call_step(search, "<search>capital</search>"))
        assert (reward, terminated, truncated) == (0.0, False, False) and info["num_results"] == 2
        obs, reward, terminated, truncated, info = asyncio.run(call_step(search, f"<search>{search.question.text}</search>"))
        assert info["num_results"] == 3
        obs, reward, terminated, _, _ = asyncio.run(call_step(search, f"<answer>{search.question.answer}</answer>"))
        assert (reward, terminated) == (1.0, True)
    finally:
        search.close()
