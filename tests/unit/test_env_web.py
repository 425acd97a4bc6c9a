"""The bundled ``web`` env: scripted episodes over its real local site, question choice, malformed
rows, the shared server's lifetime, and observations a character-level tokenizer can encode."""

from __future__ import annotations

import asyncio
import collections
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from elasticrl.env import _textgen, load_env
from elasticrl.env.base import call_reset, call_step
from elasticrl.env.web import WebEnv, WebPage, make_rows

pytestmark = pytest.mark.timeout(60)

ALLOWED = set("abcdefghijklmnopqrstuvwxyz0123456789 \n.,:;!?()[]<>/=-'_\"")


@pytest.fixture
def env():
    web = WebEnv()
    yield web
    web.close()


def page_at(env: WebEnv, path: str) -> WebPage:
    return env._fetch(path)


def clicks_to(env: WebEnv, start: str, answer: str) -> list[int] | None:
    """Link numbers of a shortest click path from ``start`` to a page whose text states ``answer``
    (breadth-first over the real site), or None if no page does."""
    queue = collections.deque([(start, [])])
    seen = {start}
    while queue:
        path, clicks = queue.popleft()
        page = page_at(env, path)
        if answer in page.text.replace(".", " ").split():
            return clicks
        for number, (href, _) in enumerate(page.links, start=1):
            if href not in seen:
                seen.add(href)
                queue.append((href, [*clicks, number]))
    return None


def play(env: WebEnv, obs: str, clicks: list[int]) -> str:
    for number in clicks:
        obs, reward, terminated, truncated, info = env.step(f"click {number}")
        assert (reward, terminated, truncated, info["valid_action"]) == (0.0, False, False, True)
    return obs


def assert_encodable(obs: str) -> None:
    assert set(obs) <= ALLOWED, f"characters {set(obs) - ALLOWED} in {obs!r}"
    assert len(obs) < 500, obs


def test_scripted_episodes_win_by_following_links_then_answering(env):
    for instance in range(6):
        obs, info = env.reset(seed=instance, options={"instance": instance})
        question = env.question
        assert obs.startswith("page: / home") and f"question: {question.text}" in obs and info["url"] == "/"
        clicks = clicks_to(env, "/", question.answer)
        assert clicks, question
        obs = play(env, obs, clicks)
        assert question.answer in obs and f"question: {question.text}" in obs
        obs, reward, terminated, truncated, info = env.step(f"answer {question.answer}\nbecause the page says so")
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert info["valid_action"] and info["correct"]


def test_wrong_answer_scores_zero_and_ends_the_episode(env):
    env.reset(seed=0, options={"instance": 3})
    obs, reward, terminated, truncated, info = env.step("answer certainly not this")
    assert (reward, terminated, truncated, info["correct"]) == (0.0, True, False, False)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("click 1")


def test_invalid_actions_explain_and_keep_the_page(env):
    env.reset(seed=0, options={"instance": 0})
    for action in ("click 99", "go to page 2", "", "answer", "click"):
        obs, reward, terminated, truncated, info = env.step(action)
        assert (reward, terminated, truncated, info["valid_action"]) == (0.0, False, False, False), action
        assert "click <n>" in obs and "answer <text>" in obs and len(obs) < 120
        assert info["url"] == "/"
    obs, *_ = env.step("click 99")
    assert "no link 99" in obs and "1-4" in obs
    # Lenient parsing: case, brackets, trailing lines.
    obs, _, _, _, info = env.step("  Click [2]\nthen more text")
    assert info["valid_action"] and info["url"] == "/c/cities"


def test_instance_picks_the_question_whatever_the_seed(env):
    count = len(env.world.questions)
    asked = {env.reset(seed=seed, options={"instance": 5})[0] for seed in range(8)}
    assert len(asked) == 1
    assert env.question == env.world.questions[5]
    env.reset(seed=1, options={"instance": 5 + count})
    assert env.question == env.world.questions[5]
    by_seed = {env.reset(seed=seed, options={})[1]["question"] for seed in range(20)}
    assert len(by_seed) > 1
    env.reset(seed=7, options=None)
    first = env.question
    env.reset(seed=7)
    assert env.question == first


def test_explicit_rows_with_a_start_page(env):
    obs, info = env.reset(options={"question": "which   city is home to the people page?", "answer": "Tarsin", "start": "/c/people"})
    assert obs.startswith("page: /c/people people") and "question: which city is home to the people page?" in obs
    obs, reward, terminated, _, _ = env.step('answer: "Tarsin."')
    assert (reward, terminated) == (1.0, True)


@pytest.mark.parametrize(
    "row,field",
    [
        ({"question": 3, "answer": "x"}, "question"),
        ({"question": "q?"}, "answer"),
        ({"answer": "x"}, "question"),
        ({"question": "q?", "answer": ["x"]}, "answer"),
        ({"instance": "2"}, "instance"),
        ({"instance": True}, "instance"),
        ({"instance": 1, "start": 5}, "start"),
        ({"instance": 1, "start": "http://example.com/"}, "start"),
    ],
)
def test_malformed_rows_name_the_field(env, row, field):
    with pytest.raises(ValueError, match=rf"options\['{field}'\]"):
        env.reset(seed=0, options=row)


@pytest.mark.parametrize("start", ["/e/9999", "/a b", "/caf\u00e9", "/c/x\ty"])
def test_a_start_page_that_does_not_exist_fails_the_episode(env, start):
    # Spaces, tabs and non-ASCII characters are quoted, not refused by http.client as InvalidURL
    # (which no env error caught): the site answers 404 like any other missing page.
    with pytest.raises(_textgen.ContentServerError, match="404"):
        env.reset(options={"instance": 0, "start": start})


def test_a_quoted_start_path_reaches_its_page(env):
    obs, info = env.reset(options={"instance": 0, "start": "/%65/0"})  # %65 is "e"
    assert info["url"] == "/%65/0" and "links:" in obs


def test_make_rows_are_answerable_from_their_start_page():
    rows = make_rows(40, site_seed=3)
    assert len(rows) == 40 and all(set(row) == {"question", "answer", "start"} for row in rows)
    env = WebEnv(site_seed=3)
    try:
        assert [row["question"] for row in rows[:5]] == [q.text for q in env.world.questions[:5]]
        for row in rows:
            assert clicks_to(env, row["start"], row["answer"]) is not None, row
        env.reset(options=rows[0])
        assert env.question.answer == rows[0]["answer"]
    finally:
        env.close()


def test_a_large_site_paginates_categories_and_every_entity_is_reachable():
    env = WebEnv(site_seed=1, pages=60)
    try:
        env.reset(seed=0)
        seen, queue = {"/"}, collections.deque(["/"])
        while queue:
            page = page_at(env, queue.popleft())
            assert len(page.links) <= 9
            for href, _ in page.links:
                if href not in seen:
                    seen.add(href)
                    queue.append(href)
        assert {f"/e/{e.index}" for e in env.world.entities} <= seen
        assert any(path.count("/") == 3 for path in seen)  # a /c/<category>/<n> page
    finally:
        env.close()


def test_observations_are_short_and_use_only_the_allowed_characters():
    env = WebEnv(site_seed=2, pages=30)
    try:
        rng = random.Random(0)
        for seed in range(10):
            obs, _ = env.reset(seed=seed)
            assert_encodable(obs)
            for _ in range(25):
                obs, *_ = env.step(rng.choice(["click 1", "click 2", "click 3", "click 4", "click 7", "look", "answer"]))
                assert_encodable(obs)
    finally:
        env.close()


def test_instances_share_one_server_which_stops_after_the_last_close():
    key = ("web", 11, 12)
    envs = [WebEnv(site_seed=11) for _ in range(3)]
    assert _textgen.SERVERS.users(key) == 0  # lazy: nothing starts before the first reset
    for i, web in enumerate(envs):
        web.reset(seed=i)
    urls = {web.base_url for web in envs}
    assert len(urls) == 1 and _textgen.SERVERS.users(key) == 3
    port = int(urls.pop().rsplit(":", 1)[1])
    envs[0].close()
    envs[0].close()  # idempotent: one lease, released once
    assert _textgen.SERVERS.users(key) == 2
    envs[1].step("click 1")  # the others still browse
    envs[1].close()
    envs[2].close()
    assert _textgen.SERVERS.users(key) == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    WebEnv().close()  # closing an instance that never started is a no-op


def test_concurrent_episodes_on_separate_instances():
    envs = [WebEnv(site_seed=5) for _ in range(8)]

    def episode(i: int) -> float:
        web = envs[i]
        obs, _ = web.reset(seed=i, options={"instance": i})
        play(web, obs, clicks_to(web, "/", web.question.answer))
        return web.step(f"answer {web.question.answer}")[1]

    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            assert list(pool.map(episode, range(8), timeout=30)) == [1.0] * 8
    finally:
        for web in envs:
            web.close()
    assert _textgen.SERVERS.users(("web", 5, 12)) == 0


def test_page_parser_reads_title_text_and_links_in_order():
    page = WebPage(
        "/c/people",
        "<html><head><title>ignored</title></head><body><h1>zorbin</h1><p>zorbin is a <b>painter</b>.</p>"
        '<a href="/">home</a> and <a href="/e/3"> tarsin </a><a href="../e/4">up</a></body></html>',
    )
    assert page.title == "zorbin"
    assert page.text == "zorbin is a painter. and"
    assert page.links == [("/", "home"), ("/e/3", "tarsin"), ("/e/4", "up")]


def test_world_is_a_pure_function_of_the_seed():
    assert _textgen.make_world(4, 12) == _textgen.make_world(4, 12)
    assert _textgen.make_world(4, 12) != _textgen.make_world(5, 12)
    names = [e.name for e in _textgen.make_world(4, 200).entities]
    assert len(names) == len(set(names))
    with pytest.raises(ValueError, match="pages"):
        WebEnv(pages=0)


def test_loads_by_name_and_passes_the_runner_checks():
    spec = load_env("web", {"site_seed": 1})
    web = spec.make()
    try:
        obs, info = asyncio.run(call_reset(web, seed=3, options={"instance": 2}))
        assert isinstance(obs, str) and info["url"] == "/"
        obs, reward, terminated, truncated, info = asyncio.run(call_step(web, "click 1"))
        assert (reward, terminated, truncated) == (0.0, False, False) and obs.startswith("page: /c/")
        obs, reward, terminated, _, _ = asyncio.run(call_step(web, f"answer {web.question.answer}"))
        assert (reward, terminated) == (1.0, True)
    finally:
        web.close()
