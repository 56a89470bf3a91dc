"""The deployment recipes in deploy/ parse, and agree with the library and the example app.

Docker and Kubernetes are not run here: these checks catch what breaks silently when the code
moves on (a probe path, a setting's name, a grace period that no longer covers the shutdown).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from fastapi.routing import APIRoute

from example_app.__main__ import GRACEFUL_SHUTDOWN_S
from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._config.settings import ENV_PREFIX, ENV_SETTINGS, Settings
from fastapi_singletonjob._election.elector import Elector
from fastapi_singletonjob._engine.engine import CANCEL_GRACE_S

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
K8S = DEPLOY / "k8s"
STATUS_PREFIX = "/singletonjob"
"""Where ``example_app.main`` mounts ``jobs.router``."""

Doc = dict[str, Any]

# -- what the recipes must agree with ------------------------------------------------------


def setting_variables() -> set[str]:
    """Every ``SINGLETONJOB_*`` variable the library reads (test_config pins ``ENV_SETTINGS``
    to the arguments of Settings.build)."""
    return {ENV_PREFIX + name.upper() for name in ENV_SETTINGS}


def probe_paths() -> tuple[str, str]:
    """(readiness, liveness) paths of the router, under the example app's prefix."""
    jobs = SingletonJobs("memory://", project="probe-paths")
    routes = {r.name: r.path for r in jobs.router.routes if isinstance(r, APIRoute)}
    return STATUS_PREFIX + routes["ready"], STATUS_PREFIX + routes["live"]


def worst_shutdown_s(env: dict[str, str]) -> float:
    """The longest graceful stop of one replica: uvicorn's HTTP drain, then the lifespan's
    drain, cancel grace and lock release (docs/lifespan.md#shutdown)."""
    release_s = float(inspect.signature(Elector.release).parameters["timeout_s"].default)
    settings = build_settings(env)
    return GRACEFUL_SHUTDOWN_S + settings.shutdown_timeout_s + CANCEL_GRACE_S + release_s


def build_settings(env: dict[str, str]) -> Settings:
    """Validate a replica's environment the way the library does at startup."""
    return Settings.build(
        redis_url=None,
        has_client=False,
        project=None,
        node_id=None,
        heartbeat_interval=None,
        lock_expiry=None,
        max_backoff=None,
        shutdown_timeout=None,
        env=env,
    )


def test_the_settings_and_routes_the_checks_rely_on() -> None:
    assert "SINGLETONJOB_LOCK_EXPIRY" in setting_variables()
    assert "SINGLETONJOB_HAS_CLIENT" not in setting_variables()
    assert probe_paths() == ("/singletonjob/health", "/singletonjob/health/live")
    from example_app.main import app

    paths = set(app.openapi()["paths"])  # included routers are not all in app.routes
    assert set(probe_paths()) <= paths, "the example app mounts the router at STATUS_PREFIX"


def check_environment(env: dict[str, str], where: str) -> Settings:
    unknown = {k for k in env if k.startswith(ENV_PREFIX)} - setting_variables()
    assert not unknown, f"{where}: not settings of the library: {sorted(unknown)}"
    return build_settings(env)


# -- docker compose ------------------------------------------------------------------------


def compose() -> Doc:
    loaded: Doc = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return loaded


def app_services() -> dict[str, Doc]:
    return {
        name: service
        for name, service in compose()["services"].items()
        if "build" in service or service.get("image") == "fastapi-singletonjob-example"
    }


def duration_s(text: str) -> float:
    """A compose duration (``30s``, ``1m30s``, ``500ms``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_runs_three_replicas_of_the_example_on_one_redis() -> None:
    services = compose()["services"]
    apps = app_services()
    assert len(apps) == 3
    for name, service in apps.items():
        build = service["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
    redis = services["redis"]
    assert redis["command"][:1] == ["redis-server"]
    assert flag(redis["command"], "--maxmemory-policy") == "noeviction"
    assert "redis-cli" in redis["healthcheck"]["test"]


def flag(args: list[str], name: str) -> str | None:
    """The value after ``name`` in an argument list."""
    return args[args.index(name) + 1] if name in args else None


def test_compose_replicas_have_valid_distinct_settings() -> None:
    apps = app_services()
    settings = {
        name: check_environment(service["environment"], name) for name, service in apps.items()
    }
    assert len({s.node_id for s in settings.values()}) == 3, "one node id per replica"
    assert len({s.project for s in settings.values()}) == 1, "one project: they elect together"
    for s in settings.values():
        url = urlsplit(s.redis_url or "")
        assert url.hostname == "redis" and (url.port or 6379) == 6379


def test_compose_healthcheck_probes_readiness_on_the_app_port() -> None:
    readiness, _ = probe_paths()
    for name, service in app_services().items():
        command = " ".join(service["healthcheck"]["test"])
        port = service["environment"]["PORT"]
        assert f"http://127.0.0.1:{port}{readiness}'" in command, name
        assert any(mapping.endswith(f":{port}") for mapping in service["ports"]), name


def test_compose_stop_grace_period_covers_the_shutdown() -> None:
    for name, service in app_services().items():
        grace_s = duration_s(service["stop_grace_period"])
        needed = worst_shutdown_s(service["environment"])
        assert grace_s > needed, f"{name}: {grace_s}s < {needed}s"


# -- Dockerfile ----------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text(encoding="utf-8"))
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def docker_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction, args in dockerfile():
        if instruction == "ENV":
            for pair in args.split():
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def test_dockerfile_serves_the_example_on_all_interfaces() -> None:
    instructions = dockerfile()
    commands = [args for instruction, args in instructions if instruction == "CMD"]
    assert commands == ['["python", "-m", "example_app"]'], "exec form: python is PID 1"
    env = docker_env()
    assert env["HOST"] == "0.0.0.0"
    exposed = [args for instruction, args in instructions if instruction == "EXPOSE"]
    assert exposed == [env["PORT"]]
    for instruction, args in instructions:
        if instruction == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such file"
    user = [args for instruction, args in instructions if instruction == "USER"]
    assert user and user[-1] != "root" and user[-1] != "0"


def test_dockerignore_sends_what_the_image_copies() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore
    copied = {
        source.rstrip("/")
        for instruction, args in dockerfile()
        if instruction == "COPY"
        for source in args.split()[:-1]
    }
    assert copied <= allowed


# -- Kubernetes ----------------------------------------------------------------------------


def k8s_docs() -> Iterator[tuple[str, Doc]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / resource).read_text(encoding="utf-8")):
            if doc:
                yield resource, doc


def k8s(kind: str, name: str) -> Doc:
    for _, doc in k8s_docs():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in deploy/k8s")


def container(deployment: Doc) -> Doc:
    containers: list[Doc] = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def container_port(spec: Doc, port: int | str) -> int:
    """A probe's or Service's port (a number or a port name) as the container's number."""
    for declared in spec["ports"]:
        if port in (declared["containerPort"], declared.get("name")):
            number: int = declared["containerPort"]
            return number
    raise AssertionError(f"port {port!r} is not declared by the container")


def plain_env(spec: Doc, pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet would set it for a pod named ``pod_name``."""
    env: dict[str, str] = {}
    for var in spec["env"]:
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = pod_name
    return env


def test_every_k8s_manifest_parses_and_is_listed() -> None:
    listed = {resource for resource, _ in k8s_docs()}
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    for _, doc in k8s_docs():
        assert {"apiVersion", "kind", "metadata"} <= set(doc)


def test_k8s_app_names_each_pod_and_uses_valid_settings() -> None:
    deployment = k8s("Deployment", "singletonjob-example")
    spec = container(deployment)
    assert deployment["spec"]["replicas"] == 3
    pod_name = next(v for v in spec["env"] if v["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    env = plain_env(spec, "singletonjob-example-7d9f8c6b5-x2k4q")
    assert env["SINGLETONJOB_NODE_ID"] == "singletonjob-example-7d9f8c6b5-x2k4q"
    settings = check_environment(env, "deploy/k8s/app.yaml")
    assert settings.node_id == "singletonjob-example-7d9f8c6b5-x2k4q"
    url = urlsplit(settings.redis_url or "")
    redis_service = k8s("Service", url.hostname or "")
    assert [p["port"] for p in redis_service["spec"]["ports"]] == [url.port or 6379]
    assert spec["image"].startswith("fastapi-singletonjob-example")
    assert env["HOST"] == docker_env()["HOST"]
    run_as = deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert [args for i, args in dockerfile() if i == "USER"] == [str(run_as)]


def test_k8s_probes_use_the_router_routes_on_the_app_port() -> None:
    readiness, liveness = probe_paths()
    spec = container(k8s("Deployment", "singletonjob-example"))
    env = plain_env(spec, "pod")
    for probe, path in (("readinessProbe", readiness), ("livenessProbe", liveness)):
        get = spec[probe]["httpGet"]
        assert get["path"] == path, probe
        assert container_port(spec, get["port"]) == int(env["PORT"]), probe


def test_k8s_grace_period_covers_the_shutdown() -> None:
    deployment = k8s("Deployment", "singletonjob-example")
    grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    needed = worst_shutdown_s(plain_env(container(deployment), "pod"))
    assert grace_s > needed


def test_k8s_services_select_their_pods_and_ports() -> None:
    for name in ("singletonjob-example", "redis"):
        deployment, service = k8s("Deployment", name), k8s("Service", name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            container_port(container(deployment), port["targetPort"])


def test_k8s_redis_never_evicts_and_explains_persistence() -> None:
    deployment = k8s("Deployment", "redis")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert flag(container(deployment)["args"], "--maxmemory-policy") == "noeviction"
    text = (K8S / "redis.yaml").read_text(encoding="utf-8")
    assert "Persistence" in text and "PersistentVolumeClaim" in text


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.y*ml")), ids=lambda p: p.name)
def test_yaml_has_no_tabs_or_duplicate_keys(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert "\t" not in text

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        # Keys written in this mapping; those merged in with `<<:` may be overridden.
        keys = [key.value for key, _ in node.value if key.tag != "tag:yaml.org,2002:merge"]
        duplicates = {k for k in keys if keys.count(k) > 1}
        assert not duplicates, f"{path.name}: duplicate keys {duplicates}"
        loader.flatten_mapping(node)
        return loader.construct_mapping(node)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    assert list(yaml.load_all(text, Loader=StrictLoader))
