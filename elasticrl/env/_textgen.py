"""Shared parts of the bundled ``web`` and ``search`` envs: a seeded world of made-up facts, the
choice of an episode's question, answer matching, and the per-process registry of the local HTTP
servers that serve the world.

The world is a few dozen fictional countries, cities, people and animals, each with two one-sentence
facts ("the capital of velmora is tarsin.", "zorbin was born in 1843 in tarsin.") and the questions
those facts answer. It is a pure function of ``(seed, entity_count)`` and builds in about a
millisecond, so every process (the env's, a standalone server's, a test's) rebuilds the same world
instead of shipping it. All text is lowercase ascii letters, digits, spaces and the punctuation
``.,:;!?()[]<>/=-'_"``, which a character-level test tokenizer can encode.

Servers are ``http.server.ThreadingHTTPServer`` on 127.0.0.1, port 0, each in a daemon thread: one
per (kind, content configuration) per process, shared by every env instance that serves the same
content and reference-counted, so the last ``release`` shuts it down.
"""

from __future__ import annotations

import dataclasses
import http.server
import logging
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Hashable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

CATEGORY_OF_KIND = {"country": "countries", "city": "cities", "person": "people", "animal": "animals"}
"""Entity kind -> the plural used for its category page and in text."""

_JOBS = ("painter", "baker", "sailor", "poet", "miner", "weaver", "doctor", "farmer", "singer", "potter")
_GOODS = ("salt", "silk", "tea", "copper", "glass", "wool", "amber", "honey", "marble", "spices")
_COLORS = ("red", "blue", "green", "yellow", "white", "black", "orange", "grey")
_ANIMAL_TYPES = ("bird", "fox", "fish", "frog", "goat", "owl", "snake", "deer")
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_FINALS = "nrslk"
# Words the templates use: a generated name must not be one of them, or a search for the name would
# also match every sentence that uses the word.
_TEMPLATE_WORDS = frozenset(
    "the capital of is known for its lies in has bridges a was born animal lives near what which how many "
    "does have job year city country kind color home people cities countries animals page".split()
    + list(_JOBS + _GOODS + _COLORS + _ANIMAL_TYPES)
)
_ANSWER_EDGES = " .,:;!?()[]<>/=-'_\"`"


@dataclasses.dataclass(frozen=True)
class Question:
    text: str
    """E.g. ``"in which year was zorbin born?"``."""
    answer: str
    """The exact answer, e.g. ``"1843"`` (compared after ``normalize_answer``)."""
    entity: str = ""
    """Name of the entity the question is about (empty for a question given by a dataset row)."""
    source: str = ""
    """The fact sentence that answers it (empty for a question given by a dataset row)."""


@dataclasses.dataclass(frozen=True)
class Fact:
    sentence: str
    questions: tuple[Question, ...]


@dataclasses.dataclass(frozen=True)
class Entity:
    index: int
    """Position in ``World.entities``; the web site serves it at ``/e/<index>``."""
    kind: str
    """One of ``CATEGORY_OF_KIND``."""
    name: str
    facts: tuple[Fact, ...]
    related: tuple[int, ...]
    """Indexes of the entities its facts mention (the web site links to them)."""


@dataclasses.dataclass(frozen=True)
class World:
    seed: int
    entities: tuple[Entity, ...]
    questions: tuple[Question, ...]
    """Every question of every fact, shuffled by the seed so that the first few cover all kinds."""

    def facts(self) -> list[Fact]:
        """All facts, in entity order."""
        return [fact for entity in self.entities for fact in entity.facts]


def _make_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    taken: set[str] = set(_TEMPLATE_WORDS)
    while len(names) < count:
        syllables = rng.randint(2, 3)
        name = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        if rng.random() < 0.5:
            name += rng.choice(_FINALS)
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def make_world(seed: int, entity_count: int) -> World:
    """The world of about ``entity_count`` entities drawn from ``seed`` (same inputs, same world).

    Kinds are mixed roughly 1 country : 1.5 cities : 2 people : 1 animal, with at least one country,
    one city per country and one person, so a tiny ``entity_count`` may give a few more entities.
    """
    if isinstance(entity_count, bool) or not isinstance(entity_count, int) or entity_count < 1:
        raise ValueError(f"entity_count: {entity_count!r} must be a positive int")
    # A string seed hashes with sha512, the same in every process whatever PYTHONHASHSEED is.
    rng = random.Random(f"elasticrl.env.world/{seed}")
    n_countries = max(1, entity_count // 6)
    n_cities = max(n_countries, entity_count // 4)
    n_animals = entity_count // 6
    n_people = max(1, entity_count - n_countries - n_cities - n_animals)
    names = iter(_make_names(rng, n_countries + n_cities + n_people + n_animals))
    countries = [next(names) for _ in range(n_countries)]
    cities = [next(names) for _ in range(n_cities)]
    people = [next(names) for _ in range(n_people)]
    animals = [next(names) for _ in range(n_animals)]
    # Entity indexes: countries first, then cities, people, animals.
    country_index = {name: i for i, name in enumerate(countries)}
    city_index = {name: n_countries + i for i, name in enumerate(cities)}
    # City i lies in country i % n_countries, so every country has a city and its first is the capital.
    country_of_city = {city: countries[i % n_countries] for i, city in enumerate(cities)}
    goods = rng.sample(_GOODS, k=min(len(_GOODS), n_countries))

    def q(text: str, answer: str, entity: str, sentence: str) -> Question:
        return Question(text=text, answer=answer, entity=entity, source=sentence)

    entities: list[Entity] = []
    for i, country in enumerate(countries):
        capital = cities[i]
        s1 = f"the capital of {country} is {capital}."
        s2 = f"{country} is known for its {goods[i % len(goods)]}."
        facts = (
            Fact(s1, (q(f"what is the capital of {country}?", capital, country, s1),)),
            Fact(s2, (q(f"what is {country} known for?", goods[i % len(goods)], country, s2),)),
        )
        entities.append(Entity(len(entities), "country", country, facts, (city_index[capital],)))
    for city in cities:
        country = country_of_city[city]
        bridges = str(rng.randint(2, 19))
        s1 = f"{city} lies in {country}."
        s2 = f"{city} has {bridges} bridges."
        facts = (
            Fact(s1, (q(f"in which country is {city}?", country, city, s1),)),
            Fact(s2, (q(f"how many bridges does {city} have?", bridges, city, s2),)),
        )
        entities.append(Entity(len(entities), "city", city, facts, (country_index[country],)))
    for person in people:
        job, year, city = rng.choice(_JOBS), str(rng.randint(1700, 1999)), rng.choice(cities)
        s1 = f"{person} is a {job}."
        s2 = f"{person} was born in {year} in {city}."
        facts = (
            Fact(s1, (q(f"what is the job of {person}?", job, person, s1),)),
            Fact(s2, (q(f"in which year was {person} born?", year, person, s2), q(f"in which city was {person} born?", city, person, s2))),
        )
        entities.append(Entity(len(entities), "person", person, facts, (city_index[city],)))
    for animal in animals:
        color, kind, city = rng.choice(_COLORS), rng.choice(_ANIMAL_TYPES), rng.choice(cities)
        s1 = f"the {animal} is a {color} {kind}."
        s2 = f"the {animal} lives near {city}."
        facts = (
            Fact(s1, (q(f"what color is the {animal}?", color, animal, s1), q(f"what kind of animal is the {animal}?", kind, animal, s1))),
            Fact(s2, (q(f"near which city does the {animal} live?", city, animal, s2),)),
        )
        entities.append(Entity(len(entities), "animal", animal, facts, (city_index[city],)))
    questions = [question for entity in entities for fact in entity.facts for question in fact.questions]
    rng.shuffle(questions)
    return World(seed=seed, entities=tuple(entities), questions=tuple(questions))


def normalize_answer(text: str) -> str:
    """Lowercase, whitespace collapsed, surrounding punctuation and quotes stripped."""
    return " ".join(text.lower().split()).strip(_ANSWER_EDGES)


def answer_matches(given: str, expected: str) -> bool:
    """Exact match after ``normalize_answer`` on both sides."""
    return normalize_answer(given) == normalize_answer(expected)


def check_row(options: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """``options`` (the task's dataset row) as a mapping; ``ValueError`` if it is not one."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(f"options: {type(options).__name__} {options!r:.80}; the dataset row must be a dict")
    return options


def question_for_episode(options: Mapping[str, Any], seed: int | None, questions: tuple[Question, ...]) -> Question:
    """The question an episode asks: the row's own ``question``/``answer``; else question number
    ``instance % len(questions)`` (every episode of a GRPO group shares its row, so they all get the
    same question whatever their seeds); else one drawn from ``seed``.

    Raises:
        ValueError: a malformed row; the message names the field.
    """
    if "question" in options or "answer" in options:
        for field in ("question", "answer"):
            value = options.get(field)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"options[{field!r}]: {value!r} must be a non-empty string (a row with a question needs both 'question' and 'answer')")
        return Question(text=" ".join(options["question"].split()), answer=options["answer"])
    if not questions:
        raise ValueError("the generated world has no questions; raise the env's pages/docs")
    if "instance" in options:
        instance = options["instance"]
        if isinstance(instance, bool) or not isinstance(instance, int):
            raise ValueError(f"options['instance']: {instance!r} must be an int")
        return questions[instance % len(questions)]
    return questions[random.Random(seed).randrange(len(questions))]


class ContentServerError(RuntimeError):
    """An env's content server could not be reached or answered with an error; fails the episode."""


def http_get(opener: urllib.request.OpenerDirector, url: str, *, timeout_s: float, max_bytes: int = 1 << 20) -> bytes:
    """The body of ``GET url``.

    Raises:
        ContentServerError: unreachable, timed out or an HTTP error status; names the url.
    """
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.read(max_bytes)
    except urllib.error.HTTPError as exc:
        raise ContentServerError(f"GET {url} answered {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ContentServerError(f"GET {url} failed after at most {timeout_s} s: {reason}") from exc
    except ValueError as exc:  # http.client.InvalidURL: a control character or space in the url
        raise ContentServerError(f"GET {url!r}: not a valid URL: {exc}") from exc


def direct_opener() -> urllib.request.OpenerDirector:
    """An opener that ignores ``http_proxy`` settings: content servers are on this host or node, and
    a cluster proxy would either refuse 127.0.0.1 or add a hop."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """Request handler base: access logs go to the debug log, not stderr; replies are bytes with a
    content type."""

    timeout = 10  # seconds a request may take to arrive; a stuck client cannot pin a thread forever

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        logger.debug("%s " + format, self.address_string(), *args)

    def reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class ContentServer(http.server.ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` sized for many env instances hitting it at once."""

    # Request threads are daemons so that shutdown never waits for a client that hangs.
    daemon_threads = True
    # The stdlib's listen backlog of 5 drops connections when a few dozen instances of a process
    # fetch at once, and a dropped SYN costs the client a 1 s retransmit.
    request_queue_size = 128


def start_http_server(handler: type[http.server.BaseHTTPRequestHandler], *, host: str = "127.0.0.1", port: int = 0) -> tuple[ContentServer, threading.Thread]:
    """A ``ContentServer`` on ``host:port`` (port 0: any free one), serving in a daemon thread."""
    server = ContentServer((host, port), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"{handler.__name__}-{server.server_address[1]}", daemon=True)
    thread.start()
    return server, thread


@dataclasses.dataclass
class _RunningServer:
    server: ContentServer
    thread: threading.Thread
    users: int

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"


class SharedServerRegistry:
    """One local server per content key per process, shared and reference-counted.

    Invariant: a key is in the table exactly while its server runs and ``users >= 1``; every
    ``acquire`` is matched by one ``release`` (the env keeps the key of its lease and releases it once).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[Hashable, _RunningServer] = {}

    def acquire(self, key: Hashable, make_handler: Callable[[], type[http.server.BaseHTTPRequestHandler]]) -> str:
        """The base url of ``key``'s server, started with ``make_handler()`` if none runs."""
        with self._lock:
            running = self._running.get(key)
            if running is None:
                server, thread = start_http_server(make_handler())
                running = self._running[key] = _RunningServer(server, thread, users=0)
                logger.debug("started content server %s for %r", running.url, key)
            running.users += 1
            return running.url

    def release(self, key: Hashable) -> None:
        """Drop one user of ``key``'s server; the last one shuts it down and waits for its thread."""
        with self._lock:
            running = self._running.get(key)
            if running is None:
                raise RuntimeError(f"content server {key!r} released more often than acquired")
            running.users -= 1
            if running.users > 0:
                return
            del self._running[key]
        # Outside the lock: shutdown waits up to one poll interval, and other keys need not wait.
        running.server.shutdown()
        running.server.server_close()
        running.thread.join(timeout=5.0)
        if running.thread.is_alive():
            logger.warning("content server %s did not stop within 5 s", running.url)
        logger.debug("stopped content server %s for %r", running.url, key)

    def users(self, key: Hashable) -> int:
        """How many leases ``key``'s server has (0: not running)."""
        with self._lock:
            running = self._running.get(key)
            return 0 if running is None else running.users


SERVERS = SharedServerRegistry()
"""The process's content servers, used by ``WebEnv`` and ``SearchEnv``."""
