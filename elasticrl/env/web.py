"""``web``: a web-navigation env (in the spirit of WebShop/WebGym) over a small generated site that
the env really fetches over HTTP and parses as HTML.

The site is a home page linking to category pages (countries, cities, people, animals), category
pages linking to entity pages, and entity pages stating two facts and linking to the entities they
mention. It is generated from ``site_seed`` (see ``_textgen``) and served by a local
``ThreadingHTTPServer`` shared by every instance in the process. Each turn the policy sees the
current page and the question, and either follows a numbered link or answers:

    page: /e/9 zorbin
    zorbin is a painter. zorbin was born in 1843 in tarsin.
    links: [1] home [2] people [3] tarsin
    question: in which year was zorbin born?
    act: click <n> or answer <text>

``answer <text>`` ends the episode with reward 1.0 if it matches the answer (after normalization),
else 0.0. Which question: the row's ``question``/``answer`` (and optional ``start`` path), else
question ``instance % count``, else one drawn from the reset ``seed``. ``make_rows`` writes rows
for a dataset file.
"""

from __future__ import annotations

import html
import html.parser
import logging
import re
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any

from elasticrl.env import _textgen
from elasticrl.env._textgen import CATEGORY_OF_KIND, Question, World, normalize_answer

logger = logging.getLogger(__name__)

CATEGORY_PAGE_SIZE = 6
"""Entity links per category page; longer categories continue on ``/c/<category>/<n>`` pages, so
a page's observation stays short whatever ``pages`` is."""
_MAX_TEXT_CHARS = 200
_ACT_LINE = "act: click <n> or answer <text>"
_CLICK = re.compile(r"click\s*\[?\s*(\d+)\s*\]?\.?")
_ANSWER = re.compile(r"answer\b\s*:?\s*(.*)")
# Tags that break text into separate words; inline tags (b, i, span) do not.
_BLOCK_TAGS = frozenset("p div li ul ol br h1 h2 h3 h4 h5 h6 tr td th table section article header footer nav".split())


def _page_html(title: str, text: str, links: list[tuple[str, str]]) -> str:
    items = "".join(f'<li><a href="{html.escape(href)}">{html.escape(label)}</a></li>' for href, label in links)
    return (
        f"<html><head><title>{html.escape(title)}</title></head><body><h1>{html.escape(title)}</h1>"
        f"<p>{html.escape(text)}</p><ul>{items}</ul></body></html>"
    )


def build_site(world: World) -> dict[str, str]:
    """Path -> HTML of every page of ``world``'s site (``/``, ``/c/<category>[/<n>]``, ``/e/<index>``)."""
    pages: dict[str, str] = {}
    categories = [c for c in CATEGORY_OF_KIND.values() if any(CATEGORY_OF_KIND[e.kind] == c for e in world.entities)]
    pages["/"] = _page_html(
        "home", "an atlas of made-up countries, cities, people and animals.", [(f"/c/{c}", c) for c in categories]
    )
    for category in categories:
        members = [e for e in world.entities if CATEGORY_OF_KIND[e.kind] == category]
        chunks = [members[i : i + CATEGORY_PAGE_SIZE] for i in range(0, len(members), CATEGORY_PAGE_SIZE)]
        for number, chunk in enumerate(chunks, start=1):
            path = f"/c/{category}" if number == 1 else f"/c/{category}/{number}"
            links = [("/", "home")] + [(f"/e/{e.index}", e.name) for e in chunk]
            if number > 1:
                links.append((f"/c/{category}" if number == 2 else f"/c/{category}/{number - 1}", "previous"))
            if number < len(chunks):
                links.append((f"/c/{category}/{number + 1}", "next"))
            pages[path] = _page_html(category, f"{category}, page {number} of {len(chunks)}.", links)
    for entity in world.entities:
        links = [("/", "home"), (f"/c/{CATEGORY_OF_KIND[entity.kind]}", CATEGORY_OF_KIND[entity.kind])]
        links += [(f"/e/{i}", world.entities[i].name) for i in entity.related]
        pages[f"/e/{entity.index}"] = _page_html(entity.name, " ".join(f.sentence for f in entity.facts), links)
    return pages


def make_rows(count: int, *, site_seed: int = 0, pages: int = 12) -> list[dict[str, str]]:
    """``count`` dataset rows ``{"question", "answer", "start"}`` answerable on the site that
    ``WebEnv(site_seed=site_seed, pages=pages)`` serves; row ``i`` is the env's question ``i``
    (the one ``options={"instance": i}`` asks), cycling when ``count`` exceeds the questions."""
    questions = _textgen.make_world(site_seed, pages).questions
    return [{"question": q.text, "answer": q.answer, "start": "/"} for q in (questions[i % len(questions)] for i in range(count))]


class _PageParser(html.parser.HTMLParser):
    """Title (``<h1>``, else ``<title>``), visible text outside headings and links, and the links
    (href, label) in document order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self.h1 = ""
        self.text: list[str] = []
        self.links: list[tuple[str, str]] = []
        self._open: list[str] = []
        self._href: str | None = None
        self._label: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCK_TAGS:
            self.text.append(" ")
        if tag == "a":
            self._href, self._label = dict(attrs).get("href"), []
        self._open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in _BLOCK_TAGS:
            self.text.append(" ")
        if tag == "a" and self._href is not None:
            self.links.append((self._href, " ".join("".join(self._label).split())))
            self._href = None
        # Tolerate unclosed tags: pop back to the matching open one, if any.
        if tag in self._open:
            while self._open.pop() != tag:
                pass

    def handle_data(self, data: str) -> None:
        if "a" in self._open:
            self._label.append(data)
        elif "h1" in self._open:
            self.h1 += data
        elif "title" in self._open:
            self.title += data
        elif not {"script", "style", "head"} & set(self._open):
            self.text.append(data)


class WebPage:
    """A fetched page: its path on the site, title, text and links (absolute paths, labels)."""

    def __init__(self, path: str, raw_html: str) -> None:
        parser = _PageParser()
        parser.feed(raw_html)
        parser.close()
        self.path = path
        self.title = " ".join((parser.h1 or parser.title).split())
        self.text = " ".join("".join(parser.text).split())
        self.links = [(urllib.parse.urljoin(path, href), label) for href, label in parser.links]


class WebEnv:
    """Navigate the generated site by clicking numbered links and answer the question.

    Args:
        site_seed: seed of the generated site (same seed, same site and questions).
        pages: roughly how many entity pages the site has (at least 1).
        http_timeout_s: timeout of every HTTP request to the site, seconds.
    """

    def __init__(self, *, site_seed: int = 0, pages: int = 12, http_timeout_s: float = 5.0):
        if isinstance(pages, bool) or not isinstance(pages, int) or not 1 <= pages <= 1000:
            raise ValueError(f"pages: {pages!r} must be an int in [1, 1000]")
        if not isinstance(http_timeout_s, (int, float)) or not http_timeout_s > 0:
            raise ValueError(f"http_timeout_s: {http_timeout_s!r} must be a positive number of seconds")
        self.site_seed = site_seed
        self.pages = pages
        self.http_timeout_s = float(http_timeout_s)
        self.world = _textgen.make_world(site_seed, pages)
        self._server_key = ("web", site_seed, pages)
        self._lease_lock = threading.Lock()
        self._base_url: str | None = None  # set while this instance holds a lease on the server
        self._opener = _textgen.direct_opener()
        self.question: Question | None = None
        self.page: WebPage | None = None
        self.done = False

    @property
    def base_url(self) -> str | None:
        """``http://127.0.0.1:<port>`` of the site while this instance uses it, else None."""
        return self._base_url

    def _ensure_server(self) -> str:
        with self._lease_lock:
            if self._base_url is None:
                world = self.world
                self._base_url = _textgen.SERVERS.acquire(self._server_key, lambda: _site_handler(build_site(world)))
            return self._base_url

    def _fetch(self, path: str) -> WebPage:
        base = self._ensure_server()
        # Quoted: a row's ``start`` may hold spaces or non-ASCII characters, which http.client
        # refuses in a URL (the handler unquotes it); '%' stays, so a quoted path is not quoted twice.
        url = base + urllib.parse.quote(path, safe="/%?=&#+:@!$'()*,;~")
        body = _textgen.http_get(self._opener, url, timeout_s=self.http_timeout_s)
        return WebPage(path, body.decode("utf-8", errors="replace"))

    def _observation(self) -> str:
        assert self.page is not None and self.question is not None
        text = self.page.text if len(self.page.text) <= _MAX_TEXT_CHARS else self.page.text[: _MAX_TEXT_CHARS - 3] + "..."
        links = " ".join(f"[{i}] {label}" for i, (_, label) in enumerate(self.page.links, start=1)) or "none"
        return f"page: {self.page.path} {self.page.title}\n{text}\nlinks: {links}\nquestion: {self.question.text}\n{_ACT_LINE}"

    def _info(self, **extra: Any) -> dict[str, Any]:
        assert self.page is not None
        return {"url": self.page.path, "num_links": len(self.page.links), **extra}

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        row = _textgen.check_row(options)
        start = row.get("start", "/")
        if not isinstance(start, str) or not start.startswith("/"):
            raise ValueError(f"options['start']: {start!r} must be a path on the site starting with '/', e.g. '/'")
        self.question = _textgen.question_for_episode(row, seed, self.world.questions)
        self.page, self.done = None, False  # a failed fetch must not leave the last episode's page
        self.page = self._fetch(start)
        return self._observation(), self._info(question=self.question.text)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.question is None or self.page is None:
            raise RuntimeError("WebEnv.step() before reset(); call reset() to start an episode")
        if self.done:
            raise RuntimeError("WebEnv.step() after the episode ended; call reset() to start another")
        lines = str(action).strip().lower().splitlines()
        command = lines[0].strip() if lines else ""
        clicked = _CLICK.fullmatch(command)
        if clicked:
            digits = clicked.group(1)
            number = int(digits) if len(digits) <= 9 else 0  # int() refuses over 4300 digits
            if not 1 <= number <= len(self.page.links):
                span = f"1-{len(self.page.links)}" if self.page.links else "none"
                shown = digits if len(digits) <= 12 else digits[:12] + "..."
                obs = f"invalid: no link {shown} on this page (links: {span}).\n{_ACT_LINE}"
                return obs, 0.0, False, False, self._info(valid_action=False)
            href, _ = self.page.links[number - 1]
            self.page = self._fetch(href)
            return self._observation(), 0.0, False, False, self._info(valid_action=True)
        answered = _ANSWER.fullmatch(command)
        if answered and not normalize_answer(answered.group(1)):
            return f"invalid: answer needs text.\n{_ACT_LINE}", 0.0, False, False, self._info(valid_action=False)
        if answered:
            correct = _textgen.answer_matches(answered.group(1), self.question.answer)
            self.done = True
            obs = "correct." if correct else "wrong."
            return obs, float(correct), True, False, self._info(valid_action=True, correct=correct, answer=self.question.answer)
        return f"invalid action. {_ACT_LINE}, e.g. click 1", 0.0, False, False, self._info(valid_action=False)

    def close(self) -> None:
        """Release this instance's lease on the site's server (the last user stops it); idempotent."""
        with self._lease_lock:
            if self._base_url is None:
                return
            self._base_url = None
            _textgen.SERVERS.release(self._server_key)


def _site_handler(site: dict[str, str]) -> type[_textgen.QuietHandler]:
    """A handler class serving the pages of ``site`` (path -> HTML); 404 elsewhere."""

    class SiteHandler(_textgen.QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            if len(path) > 1:
                path = path.rstrip("/")
            page = site.get(path)
            if page is None:
                self.reply(404, _page_html("not found", f"no page at {path}.", [("/", "home")]).encode(), "text/html; charset=utf-8")
            else:
                self.reply(200, page.encode(), "text/html; charset=utf-8")

    return SiteHandler
