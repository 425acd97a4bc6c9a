"""Where the launch files under ``deploy/`` keep their shell and their commands, with line numbers.

``tests/unit/test_deploy.py`` checks what this module finds: the scripts inside every file (the
sbatch script, SkyPilot's ``setup``/``run``, ``sh -c`` strings of Compose and Kubernetes, the
README's ``sh`` blocks, the Dockerfile's ``RUN`` lines) and every call of ``elasticrl SUB``,
``torchrun`` and ``python -m elasticrl.node`` in them or in exec-form YAML lists. Everything carries
a ``Source`` (file and line), so a failing check can say where the problem is. Pure text
processing: PyYAML and shlex, nothing is run.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import shlex
import typing

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PUNCTUATION = ";&|()<>"
SHELLS = {"sh", "/bin/sh", "bash", "/bin/bash"}


# -- where things are ------------------------------------------------------------------------------


@functools.cache
def lines_of(path: pathlib.Path) -> tuple[str, ...]:
    return tuple(path.read_text().splitlines())


@dataclasses.dataclass(frozen=True)
class Source:
    """A line of a deploy file (1-based), printed as ``deploy/x.yaml:12``."""

    path: pathlib.Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def find(self, needle: str) -> "Source":
        """The first line at or after this one that contains ``needle`` (this one if none does)."""
        lines = lines_of(self.path)
        for number in range(self.line, len(lines) + 1):
            if needle in lines[number - 1]:
                return Source(self.path, number)
        return self


def deploy_files(pattern: str) -> list[pathlib.Path]:
    return sorted(p for p in DEPLOY.rglob(pattern) if p.is_file())


# -- YAML with line numbers ------------------------------------------------------------------------


def yaml_documents(path: pathlib.Path) -> list[tuple[typing.Any, yaml.Node]]:
    """Each document as (data, node); the node tree gives the line of any value."""
    with path.open() as stream:  # a file stream: parse errors name the file
        loader = yaml.SafeLoader(stream)
        docs = []
        try:
            while loader.check_node():
                node = loader.get_node()
                docs.append((loader.construct_document(node), node))
        finally:
            loader.dispose()
    return docs


def parsed_yaml(path: pathlib.Path) -> list[tuple[typing.Any, yaml.Node]]:
    """For collecting scripts and commands: a file that does not parse has none (its own test says why)."""
    try:
        return yaml_documents(path)
    except yaml.YAMLError:
        return []


def node_at(node: yaml.Node, *keys: typing.Any) -> yaml.Node:
    """The node at a path of mapping keys and sequence indices (as far as the path exists)."""
    for key in keys:
        if isinstance(node, yaml.MappingNode):
            found = [v for k, v in node.value if k.value == key]
            if not found:
                return node
            node = found[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            return node
    return node


def source_of(path: pathlib.Path, node: yaml.Node) -> Source:
    """Where a value's text starts: block scalars (| and >) start on the line after the indicator."""
    block = isinstance(node, yaml.ScalarNode) and node.style in ("|", ">")
    return Source(path, node.start_mark.line + (2 if block else 1))


# -- scripts and commands --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Script:
    """Shell text inside a deploy file, with the file line of its first line."""

    where: Source
    text: str
    shell: str  # "bash" or "sh" (shellcheck's dialect)


@dataclasses.dataclass(frozen=True)
class Invocation:
    """One call of ``elasticrl SUB``, ``torchrun`` or ``python -m elasticrl.node`` and its arguments."""

    where: Source
    kind: str  # "cli", "torchrun" or "node"
    args: tuple[str, ...]
    sub: str = ""


def _logical_lines(script: Script) -> list[tuple[int, str]]:
    """Lines joined over backslash-newlines and open quotes, each with its first line's number."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, line in enumerate(script.text.splitlines(), start=script.where.line):
        if not pending:
            start = number
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote spans lines
            pending += "\n"
            continue
        out.append((start, pending))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def simple_commands(script: Script) -> list[tuple[Source, list[str]]]:
    """Token lists of the script's simple commands (split at ; && | & ( ) and redirections)."""
    commands = []
    for start, line in _logical_lines(script):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=PUNCTUATION)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError as exc:
            raise AssertionError(f"{Source(script.where.path, start)}: cannot tokenize: {exc}") from None
        current: list[str] = []
        for token in tokens + [";"]:
            if token and all(ch in PUNCTUATION for ch in token):
                if current:
                    commands.append((Source(script.where.path, start), current))
                current = []
            else:
                current.append(token)
    return commands


def _command_word(tokens: list[str], i: int) -> bool:
    """Is tokens[i] in command position (after assignments, exec, CMD or a -- separator)?"""
    j = 0
    while j < i and (re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[j]) or tokens[j] in ("exec", "CMD", "CMD-SHELL")):
        j += 1
    return i == j or (i > 0 and tokens[i - 1] == "--")


def invocations_in_argv(where: Source, tokens: list[str]) -> list[Invocation]:
    """The elasticrl / torchrun / node calls in one argv; quoted scripts inside are searched too."""
    found: list[Invocation] = []
    for token in tokens:  # ssh host '...', bash -c '...': a script inside one argument
        if ("\n" in token or " " in token) and ("elasticrl" in token or "torch" in token):
            found += invocations(Script(where, token, "sh"))
    for i, token in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token == "-m" and nxt == "torch.distributed.run" or _command_word(tokens, i) and (token == "torchrun" or token.endswith("/torchrun")):
            rest = tokens[i + (2 if token == "-m" else 1):]
            end = rest.index("-m") if "-m" in rest else len(rest)
            found.append(Invocation(where, "torchrun", tuple(rest[:end])))
            if rest[end + 1:end + 2] == ["elasticrl.node"]:
                found.append(Invocation(where, "node", tuple(rest[end + 2:])))
            break
        if token == "-m" and nxt == "elasticrl.node":
            found.append(Invocation(where, "node", tuple(tokens[i + 2:])))
            break
        if token == "-m" and nxt in ("elasticrl", "elasticrl.cli") or _command_word(tokens, i) and (token == "elasticrl" or token.endswith("/elasticrl")):
            rest = tokens[i + (2 if token == "-m" else 1):]
            while rest and rest[0].startswith("-"):  # global options: --log-level X, --version
                rest = rest[2:] if rest[0] == "--log-level" else rest[1:]
            if rest:
                found.append(Invocation(where, "cli", tuple(rest[1:]), sub=rest[0]))
            break
    return found


def invocations(script: Script) -> list[Invocation]:
    found = []
    for where, tokens in simple_commands(script):
        found += invocations_in_argv(where, tokens)
    return found


def compose_text(text: str) -> str:
    return text.replace("$$", "$")  # compose's escape of a literal $


def exec_forms() -> list[tuple[Source, list[str], bool]]:
    """Exec-form argv lists of the YAML files: (where, argv, is_compose)."""
    out = []
    for path in deploy_files("*.yaml"):
        for data, root in parsed_yaml(path):
            if not isinstance(data, dict):
                continue
            if path.name.startswith("compose"):
                for name, svc in (data.get("services") or {}).items():
                    for key in ("command", "entrypoint"):
                        if isinstance(svc.get(key), list):
                            out.append((source_of(path, node_at(root, "services", name, key)), svc[key], True))
                    test = (svc.get("healthcheck") or {}).get("test")
                    if isinstance(test, list):
                        out.append((source_of(path, node_at(root, "services", name, "healthcheck", "test")), test, True))
            for keys, pod in pod_specs(data):
                for c, container in enumerate(pod.get("containers", [])):
                    argv = list(container.get("command", [])) + list(container.get("args", []))
                    if argv:
                        key = "command" if container.get("command") else "args"
                        out.append((source_of(path, node_at(root, *keys, "containers", c, key)), argv, False))
    return out


@functools.cache
def all_scripts() -> tuple[Script, ...]:
    scripts = []
    for path in deploy_files("*.sh") + deploy_files("*.sbatch"):
        first = path.read_text().splitlines()[0] if path.read_text() else ""
        scripts.append(Script(Source(path, 1), path.read_text(), "sh" if first.endswith("/sh") else "bash"))
    sky = DEPLOY / "skypilot"
    for path in sorted(sky.glob("*.yaml")):
        for data, root in parsed_yaml(path):
            for key in ("setup", "run"):
                if isinstance(data.get(key), str):
                    scripts.append(Script(source_of(path, node_at(root, key)), data[key], "bash"))
    for where, argv, compose in exec_forms():
        if len(argv) >= 3 and argv[0] in SHELLS and argv[1] == "-c":
            text = compose_text(argv[2]) if compose else argv[2]
            line = where.find(argv[2].splitlines()[0]) if argv[2] else where
            scripts.append(Script(line, text, "bash" if argv[0].endswith("bash") else "sh"))
    for path in deploy_files("*.md"):
        scripts += [Script(where, text, "bash") for where, lang, text in fenced_blocks(path) if lang in ("sh", "bash")]
    for path in deploy_files("Dockerfile*"):
        if path.suffix != ".dockerignore":
            scripts += [Script(where, args, "sh") for where, instr, args in dockerfile(path) if instr == "RUN"]
    return tuple(dict.fromkeys(scripts))  # compose's merged x-node script appears once per service


@functools.cache
def all_invocations() -> tuple[Invocation, ...]:
    found = []
    for script in all_scripts():
        found += invocations(script)
    for where, argv, compose in exec_forms():
        if not (len(argv) >= 3 and argv[0] in SHELLS and argv[1] == "-c"):
            found += invocations_in_argv(where, [compose_text(a) if compose else a for a in argv])
    return tuple(dict.fromkeys(found))


def fenced_blocks(path: pathlib.Path) -> list[tuple[Source, str, str]]:
    """Markdown ``` blocks: (where the first line of the block's text is, language, text)."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(lines_of(path), start=1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), number + 1, []
            else:
                blocks.append((Source(path, start), lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def dockerfile(path: pathlib.Path) -> list[tuple[Source, str, str]]:
    """Instructions as (where, INSTRUCTION, arguments), continuation lines joined."""
    out, pending, start = [], "", 0
    for number, line in enumerate(lines_of(path), start=1):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):  # kept: RUN text stays valid shell, line for line
            pending += line + "\n"
            continue
        pending += line
        instr, _, args = pending.strip().partition(" ")
        out.append((Source(path, start), instr.upper(), args.strip()))
        pending = ""
    return out


def pod_specs(doc: dict) -> list[tuple[tuple, dict]]:
    """(path to the pod spec, pod spec) of a workload manifest."""
    spec = doc.get("spec") or {}
    if doc.get("kind") in ("Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet"):
        return [(("spec", "template", "spec"), spec.get("template", {}).get("spec", {}))]
    if doc.get("kind") == "Pod":
        return [(("spec",), spec)]
    return []
