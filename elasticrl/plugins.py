"""Loading a user's Python object named in a config: ``"package.module:name"`` or ``"path/file.py:name"``.

Reward functions (``algorithm.rewards``) and environments (``env.name``) are both named this way,
so a user's code needs no package and no install: a file next to the config is enough. A file is
imported under a name derived from its full path (two ``rewards.py`` files do not collide) and
registered in ``sys.modules`` (dataclasses and pickle-free typing resolve a class's module there).
Every failure raises the caller's error class with a message naming the spec and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from pathlib import Path

SPEC_FORMS = "'package.module:name' or 'path/to/file.py:name'"
_FILES: dict[str, str] = {}  # the module name a user's file is imported under -> the file as the spec gave it


def module_label(module_name: str) -> str:
    """How messages name a module: a user's file as its spec gave it (``my_env.py``), else its name."""
    return _FILES.get(module_name, module_name)


def is_file_part(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or "\\" in module_part


def _module_from_file(spec: str, file_part: str, what: str, error: type[Exception]) -> object:
    resolved = Path(file_part).expanduser().resolve()  # relative paths are taken from the current directory
    if not resolved.is_file():
        raise error(f"{what} {spec!r}: file {file_part!r} does not exist (looked at {resolved})")
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    module_name = f"_elasticrl_user_{re.sub(r'[^0-9A-Za-z_]', '_', resolved.stem)}_{digest}"
    if module_name in sys.modules:  # loaded before (e.g. the reward file is also the env file)
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{what} {spec!r}: {resolved} cannot be loaded as a Python module (does it end in .py?)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise error(f"{what} {spec!r}: running {resolved} failed with {type(e).__name__}: {e}") from e
    _FILES[module_name] = file_part
    return module


def _module_from_import(spec: str, module_part: str, what: str, error: type[Exception]) -> object:
    try:
        return importlib.import_module(module_part)
    except ImportError as e:
        raise error(f"{what} {spec!r}: module {module_part!r} is not importable: {e}") from e
    except Exception as e:
        raise error(f"{what} {spec!r}: importing module {module_part!r} failed with {type(e).__name__}: {e}") from e


def load_object(spec: str, *, what: str, error: type[Exception]) -> object:
    """The object ``spec`` names (``"package.module:name"`` or ``"path/to/file.py:name"``; a
    relative path is taken from the current directory).

    ``what`` names the kind in messages ("reward", "env"); ``error`` is the exception class raised.

    Raises:
        error: no ``:``, an empty part, a module that cannot be imported (with the ImportError's
            text), a missing file, or a missing attribute (the message lists the public ones).
    """
    module_part, sep, attr = spec.rpartition(":")  # rpartition: a Windows drive letter keeps its colon
    if not sep or not module_part or not attr:
        raise error(f"{what} {spec!r}: write {SPEC_FORMS} (both parts non-empty)")
    if is_file_part(module_part):
        module = _module_from_file(spec, module_part, what, error)
    else:
        module = _module_from_import(spec, module_part, what, error)
    try:
        return getattr(module, attr)
    except AttributeError:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        hint = f"; its public callables: {', '.join(found)}" if found else ""
        raise error(f"{what} {spec!r}: {module_part!r} has no attribute {attr!r}{hint}") from None
