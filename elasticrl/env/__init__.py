"""Environments the policy acts in: the contract (``base``), how a config names one (here), a
single-turn prompt env (``prompt``), a turn limit (``wrappers``) and bundled envs (``guess``,
``web``, ``search``).

``[env] name`` is resolved by ``load_env``:

* a registered name (``guess``, ``web``, ``search``; ``register_env`` adds more);
* ``"package.module:Class"``, imported with importlib;
* ``"path/to/file.py:Class"``, loaded from that file (relative to the current directory).

Any callable that returns an env works as the "class" (a class, a factory function, a
``functools.partial``). ``load_env`` checks the spec and the ``kwargs`` against the callable's
signature at once, so a bad config stops the run before anything starts; envs themselves are
built later, one per live episode, by the episode runner. Nothing here imports torch or knows of
engines and the scheduler.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from elasticrl.env.base import Env, EnvError, EnvLoadError, Observation, call_close, call_reset, call_step
from elasticrl.plugins import SPEC_FORMS, load_object

EnvFactory = Callable[..., Any]

_REGISTRY: dict[str, str | EnvFactory] = {
    "guess": "elasticrl.env.guess:GuessEnv",
    "web": "elasticrl.env.web:WebEnv",
    "search": "elasticrl.env.search:SearchEnv",
}


def env_names() -> list[str]:
    """Registered env names, sorted."""
    return sorted(_REGISTRY)


def register_env(name: str, factory: str | EnvFactory, *, replace: bool = False) -> None:
    """Register ``factory`` (a callable, or a ``"module:Class"`` string imported on first use) as
    ``name``; refuses to shadow a registered name unless ``replace``."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"env name {name!r} must be a non-empty string without ':'")
    if name in _REGISTRY and not replace:
        raise ValueError(f"env {name!r} is already registered; pass replace=True to override it")
    _REGISTRY[name] = factory


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """A resolved ``[env]``: what to build and with which keyword arguments."""

    name: str
    """The spec as written in the config (a registered name or module/file:Class)."""
    factory: EnvFactory
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def make(self) -> Any:
        """A new env instance; ``EnvError`` if the constructor raises."""
        try:
            return self.factory(**self.kwargs)
        except Exception as exc:
            raise EnvError(f"env {self.name!r}: building it with kwargs {dict(self.kwargs)} raised {type(exc).__name__}: {exc}") from exc


def _resolve(name: str) -> EnvFactory:
    entry = _REGISTRY.get(name)
    if entry is None and ":" not in name:
        raise EnvLoadError(f"env {name!r} is not registered; choose one of {', '.join(env_names())}, or name a class as {SPEC_FORMS}")
    if entry is None:
        entry = name
    if isinstance(entry, str):
        module, _, attr = entry.rpartition(":")
        if entry is not name:  # a registered bundled env: import errors are ours, not the user's
            return getattr(importlib.import_module(module), attr)
        return load_object(entry, what="env", error=EnvLoadError)  # type: ignore[return-value]
    return entry


def load_env(name: str, kwargs: Mapping[str, Any] | None = None) -> EnvSpec:
    """Resolve ``name`` and check ``kwargs`` against the env's constructor.

    Raises:
        EnvLoadError: unknown name (the message lists the registered ones), a module or file that
            cannot be loaded, a missing attribute, something that is not callable, a class without
            ``reset``/``step``, or ``kwargs`` its constructor does not accept.
    """
    if not isinstance(name, str) or not name.strip():
        raise EnvLoadError(f"env name {name!r} must be a non-empty string: {', '.join(env_names())} or {SPEC_FORMS}")
    kwargs = dict(kwargs or {})
    factory = _resolve(name)
    if not callable(factory):
        raise EnvLoadError(f"env {name!r} is a {type(factory).__name__}, not a class or factory")
    if inspect.isclass(factory):
        missing = [m for m in ("reset", "step") if not callable(getattr(factory, m, None))]
        if missing:
            raise EnvLoadError(
                f"env {name!r}: class {factory.__qualname__} has no {' or '.join(m + '()' for m in missing)}; an env needs "
                "reset(seed=None, options=None) -> (obs, info) and step(action) -> (obs, reward, terminated, truncated, info)"
            )
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise EnvLoadError(f"env {name!r}: env.kwargs {kwargs} do not fit its constructor: {exc}") from None
    except ValueError:
        pass  # no introspectable signature; the first construction will tell
    return EnvSpec(name=name, factory=factory, kwargs=kwargs)


__all__ = [
    "Env", "EnvError", "EnvFactory", "EnvLoadError", "EnvSpec", "Observation", "call_close", "call_reset", "call_step",
    "env_names", "load_env", "register_env",
]
