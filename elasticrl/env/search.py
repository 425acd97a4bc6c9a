"""``search``: a search-tool env in the spirit of Search-R1, backed by a BM25 retrieval server over a
generated corpus of one-sentence facts.

The corpus is the fact sentences of a world generated from ``corpus_seed`` (see ``_textgen``),
e.g. "zorbin was born in 1843 in tarsin.". A local ``ThreadingHTTPServer`` (one per process and
corpus, shared by every instance; or an already-running one named by ``server_url``, e.g. one per
node started with ``python -m elasticrl.env.search --port 8000``) ranks it with Okapi BM25 and
answers ``GET /search?q=...&k=3`` with ``{"results": [{"id": ..., "text": ...}, ...]}``. A turn
looks like::

    question: in which year was zorbin born?
    use <search>query</search> to search and <answer>text</answer> to answer.
    <search>zorbin born</search>                     (the policy)
    <information>(1) zorbin was born in 1843 in tarsin. (2) zorbin is a painter.</information>
    <answer>1843</answer>                            (the policy; reward 1.0, terminated)

The first tag of an action decides it; ``<answer>`` gives reward 1.0 on a match (after
normalization), else 0.0. Which question: the row's ``question``/``answer``, else question
``instance % count``, else one drawn from the reset ``seed``. ``make_rows`` writes dataset rows.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import re
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from elasticrl.env import _textgen
from elasticrl.env._textgen import Question

logger = logging.getLogger(__name__)

_MAX_DOC_CHARS = 150
_MAX_QUERY_CHARS = 200
_MAX_K = 20
_INSTRUCTION = "use <search>query</search> to search and <answer>text</answer> to answer."
_INVALID = "invalid action. use <search>query</search> or <answer>text</answer>."
# The first opening tag decides the action; its text runs to the closing tag, or to the end of the
# action if the policy forgot to close it.
_TAG = re.compile(r"<(search|answer)>(.*?)(?:</\1>|$)", re.DOTALL)
_TOKEN = re.compile(r"[a-z0-9]+")
# Lucene's English stop words, which Pyserini's BM25 (Search-R1's sparse retriever) also drops:
# kept, "what is the job of kuful?" ranks "the capital of zimope is fepuben." above "kuful is a
# doctor." on the rare word "of" alone.
STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these they this "
    "to was will with".split()
)


def tokenize(text: str) -> list[str]:
    """Lowercase alphanumeric runs (punctuation separates words), stop words dropped."""
    return [token for token in _TOKEN.findall(text.lower()) if token not in STOP_WORDS]


class BM25Index:
    """Okapi BM25 over a fixed list of documents.

    Written here rather than imported: it is forty lines, no BM25 package is a dependency of
    elasticrl, and owning it pins the idf variant. Idf is Lucene's ``log(1 + (N - n + 0.5) / (n +
    0.5))``, which stays positive for a term in more than half the documents (the classic Okapi idf
    goes negative there and would rank documents down for containing a query word).
    """

    def __init__(self, docs: Sequence[str], *, k1: float = 1.2, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self._term_counts = [collections.Counter(tokenize(doc)) for doc in docs]
        self._lengths = [sum(counts.values()) for counts in self._term_counts]
        self._avg_length = (sum(self._lengths) / len(self._lengths)) if self._lengths else 0.0
        doc_freq: collections.Counter[str] = collections.Counter()
        for counts in self._term_counts:
            doc_freq.update(counts.keys())
        n = len(self._term_counts)
        self._idf = {term: math.log(1.0 + (n - df + 0.5) / (df + 0.5)) for term, df in doc_freq.items()}

    def score(self, query_terms: Sequence[str], doc: int) -> float:
        counts, length = self._term_counts[doc], self._lengths[doc]
        norm = self.k1 * (1.0 - self.b + self.b * length / self._avg_length) if self._avg_length else self.k1
        total = 0.0
        for term in query_terms:
            tf = counts.get(term, 0)
            if tf:
                total += self._idf[term] * tf * (self.k1 + 1.0) / (tf + norm)
        return total

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """The ``k`` best (doc index, score) pairs with a positive score, best first; ties keep
        corpus order, so results are deterministic."""
        terms = [t for t in tokenize(query) if t in self._idf]
        if not terms:
            return []
        scored = [(doc, self.score(terms, doc)) for doc in range(len(self._term_counts))]
        scored = [pair for pair in scored if pair[1] > 0.0]
        scored.sort(key=lambda pair: (-pair[1], pair[0]))
        return scored[:k]


def build_corpus(corpus_seed: int, docs: int) -> tuple[list[str], tuple[Question, ...]]:
    """The ``docs`` documents of the corpus and the questions they answer (in the world's order)."""
    if isinstance(docs, bool) or not isinstance(docs, int) or not 1 <= docs <= 10_000:
        raise ValueError(f"docs: {docs!r} must be an int in [1, 10000]")
    # Every entity has two facts, so half as many entities as documents, rounded up, is enough.
    world = _textgen.make_world(corpus_seed, (docs + 1) // 2)
    texts = [fact.sentence for fact in world.facts()[:docs]]
    kept = set(texts)
    return texts, tuple(q for q in world.questions if q.source in kept)


def make_rows(count: int, *, corpus_seed: int = 0, docs: int = 30) -> list[dict[str, str]]:
    """``count`` dataset rows ``{"question", "answer"}`` answerable from the corpus that
    ``SearchEnv(corpus_seed=corpus_seed, docs=docs)`` searches; row ``i`` is the env's question
    ``i`` (the one ``options={"instance": i}`` asks), cycling when ``count`` exceeds the questions."""
    _, questions = build_corpus(corpus_seed, docs)
    return [{"question": q.text, "answer": q.answer} for q in (questions[i % len(questions)] for i in range(count))]


def _search_handler(corpus_seed: int, docs: int) -> type[_textgen.QuietHandler]:
    """A handler class answering ``/search`` over the ``(corpus_seed, docs)`` corpus and ``/healthz``."""
    texts, _ = build_corpus(corpus_seed, docs)
    index = BM25Index(texts)
    health = json.dumps({"status": "ok", "corpus_seed": corpus_seed, "docs": docs}).encode()

    class SearchHandler(_textgen.QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/healthz":
                self.reply(200, health, "application/json")
                return
            if url.path != "/search":
                self._error(404, f"no endpoint {url.path}; use /search?q=...&k=3 or /healthz")
                return
            params = urllib.parse.parse_qs(url.query)
            query = params.get("q", [""])[0]
            k_text = params.get("k", ["3"])[0]
            if not k_text.isdigit() or not 1 <= int(k_text) <= _MAX_K:
                self._error(400, f"k: {k_text!r} must be an int in [1, {_MAX_K}]")
                return
            hits = index.search(query, int(k_text))
            body = {"results": [{"id": doc, "text": texts[doc], "score": round(score, 4)} for doc, score in hits]}
            self.reply(200, json.dumps(body).encode(), "application/json")

        def _error(self, status: int, message: str) -> None:
            self.reply(status, json.dumps({"error": message}).encode(), "application/json")

    return SearchHandler


class SearchEnv:
    """Answer a question about the generated corpus, searching it with ``<search>`` as often as needed.

    Args:
        corpus_seed: seed of the generated corpus (same seed, same documents and questions).
        docs: number of documents in the corpus.
        top_k: documents shown per search.
        server_url: base url of an already-running search server for this corpus (e.g.
            ``http://node0:8000``, started with ``python -m elasticrl.env.search``); empty: start one
            in this process, shared by its instances.
        http_timeout_s: timeout of every HTTP request to the server, seconds.
    """

    # An action ends at its first closing tag, as Search-R1's generation stops there: text after it
    # (a made-up <information> block, say) is neither read nor trained on.
    stop_strings = ("</search>", "</answer>")

    def __init__(self, *, corpus_seed: int = 0, docs: int = 30, top_k: int = 2, server_url: str = "", http_timeout_s: float = 5.0):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= _MAX_K:
            raise ValueError(f"top_k: {top_k!r} must be an int in [1, {_MAX_K}]")
        if not isinstance(server_url, str) or (server_url and not server_url.startswith(("http://", "https://"))):
            raise ValueError(f"server_url: {server_url!r} must be empty or an http(s):// url, e.g. 'http://127.0.0.1:8000'")
        if not isinstance(http_timeout_s, (int, float)) or not http_timeout_s > 0:
            raise ValueError(f"http_timeout_s: {http_timeout_s!r} must be a positive number of seconds")
        self.corpus_seed, self.docs, self.top_k = corpus_seed, docs, top_k
        self.http_timeout_s = float(http_timeout_s)
        self.documents, self.questions = build_corpus(corpus_seed, docs)
        self._external_url = server_url.rstrip("/")
        self._server_key = ("search", corpus_seed, docs)
        self._lease_lock = threading.Lock()
        self._base_url: str | None = None  # set once the server is known to be up (and leased, if ours)
        self._opener = _textgen.direct_opener()
        self.question: Question | None = None
        self.done = False

    @property
    def base_url(self) -> str | None:
        """The search server's url while this instance uses it, else None."""
        return self._base_url

    def _ensure_server(self) -> str:
        with self._lease_lock:
            if self._base_url is not None:
                return self._base_url
            if not self._external_url:
                seed, docs = self.corpus_seed, self.docs
                self._base_url = _textgen.SERVERS.acquire(self._server_key, lambda: _search_handler(seed, docs))
                return self._base_url
            # A shared server must serve this env's corpus, or questions and documents disagree.
            health = json.loads(_textgen.http_get(self._opener, self._external_url + "/healthz", timeout_s=self.http_timeout_s))
            if (health.get("corpus_seed"), health.get("docs")) != (self.corpus_seed, self.docs):
                raise _textgen.ContentServerError(
                    f"search server {self._external_url} serves corpus_seed={health.get('corpus_seed')} docs={health.get('docs')}, "
                    f"but this env has corpus_seed={self.corpus_seed} docs={self.docs}; start the server with the env's kwargs"
                )
            self._base_url = self._external_url
            return self._base_url

    def search(self, query: str, k: int | None = None) -> list[dict[str, Any]]:
        """The server's top ``k`` (default ``top_k``) results for ``query``: ``{"id", "text", ...}`` dicts.

        Raises:
            ContentServerError: the server is unreachable, failed, or answered malformed JSON.
        """
        base = self._ensure_server()
        url = f"{base}/search?{urllib.parse.urlencode({'q': query, 'k': k or self.top_k})}"
        body = _textgen.http_get(self._opener, url, timeout_s=self.http_timeout_s)
        try:
            results = json.loads(body)["results"]
            assert isinstance(results, list) and all(isinstance(r, dict) and isinstance(r.get("text"), str) for r in results)
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            raise _textgen.ContentServerError(f"GET {url} answered {body[:80]!r}, not {{'results': [{{'id', 'text'}}, ...]}}") from exc
        return results

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.question = _textgen.question_for_episode(_textgen.check_row(options), seed, self.questions)
        self._ensure_server()  # fail the episode now, not at its first search, if the server is down
        self.done = False
        return f"question: {self.question.text}\n{_INSTRUCTION}", {"question": self.question.text}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.question is None:
            raise RuntimeError("SearchEnv.step() before reset(); call reset() to start an episode")
        if self.done:
            raise RuntimeError("SearchEnv.step() after the episode ended; call reset() to start another")
        tag = _TAG.search(str(action).lower())
        if tag is None:
            return _INVALID, 0.0, False, False, {"valid_action": False}
        kind, content = tag.group(1), " ".join(tag.group(2).split())
        if kind == "answer":
            correct = _textgen.answer_matches(content, self.question.answer)
            self.done = True
            info = {"valid_action": True, "correct": correct, "answer": self.question.answer}
            return ("correct." if correct else "wrong."), float(correct), True, False, info
        if not content:
            return "invalid: empty query. use <search>query</search> or <answer>text</answer>.", 0.0, False, False, {"valid_action": False}
        query = content[:_MAX_QUERY_CHARS]
        results = self.search(query)
        shown = " ".join(f"({i}) {_clip(r['text'])}" for i, r in enumerate(results, start=1)) or "no results."
        info = {"valid_action": True, "query": query, "num_results": len(results), "doc_ids": [r.get("id") for r in results]}
        return f"<information>{shown}</information>", 0.0, False, False, info

    def close(self) -> None:
        """Release this instance's lease on the process's server (the last user stops it); idempotent."""
        with self._lease_lock:
            if self._base_url is None:
                return
            self._base_url = None
            if not self._external_url:
                _textgen.SERVERS.release(self._server_key)


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_DOC_CHARS else text[: _MAX_DOC_CHARS - 3] + "..."


def serve(*, host: str = "127.0.0.1", port: int = 8000, corpus_seed: int = 0, docs: int = 30) -> tuple[_textgen.ContentServer, threading.Thread]:
    """Start a standalone search server (a ``ThreadingHTTPServer`` in a daemon thread) and return
    it with its thread; the caller stops it with ``shutdown()`` and ``server_close()``."""
    return _textgen.start_http_server(_search_handler(corpus_seed, docs), host=host, port=port)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m elasticrl.env.search``: serve a corpus until interrupted (one server per node)."""
    parser = argparse.ArgumentParser(prog="python -m elasticrl.env.search", description="Serve the search env's BM25 corpus over HTTP.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: reachable from other hosts); default %(default)s")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: any free port); default %(default)s")
    parser.add_argument("--corpus-seed", type=int, default=0, help="seed of the generated corpus; must equal the env's corpus_seed; default %(default)s")
    parser.add_argument("--docs", type=int, default=30, help="number of documents; must equal the env's docs; default %(default)s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server, thread = serve(host=args.host, port=args.port, corpus_seed=args.corpus_seed, docs=args.docs)
    host, port = server.server_address[:2]
    logger.info("serving corpus_seed=%d docs=%d on http://%s:%d (GET /search?q=...&k=3, /healthz)", args.corpus_seed, args.docs, host, port)
    try:
        thread.join()
    except KeyboardInterrupt:
        logger.info("interrupted; stopping")
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
