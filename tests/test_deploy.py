"""deploy/: what ships is valid, safe, and agrees with the code's defaults.

Strategy: render every kustomization with a small kustomize (resources plus
strategic-merge patches, the only features the manifests use; anything else is
an error so the renderer cannot silently ignore it), cross-check that renderer
against `kubectl kustomize` where kubectl exists, then validate the result
against the Kubernetes schemas (kubernetes-validate), scan it and the
Dockerfile with checkov, and hold ports, probes, env and the grace period
against `Settings`. The alert rules go through `promtool check` and a
generated `promtool test rules` with a firing and a quiet trace per alert.

External tools (checkov, promtool, kubectl) are skipped when missing, except
in CI (CI=true), where a missing tool fails the test.
"""

from __future__ import annotations

import copy
import functools
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from pylon.auth import require_configured_auth
from pylon.config import Settings, load_settings, split_host_port

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
KUBE = DEPLOY / "kubernetes"
RULES_FILE = DEPLOY / "prometheus" / "pylon-rules.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
OPERATIONS_MD = REPO / "docs" / "operations.md"

KUSTOMIZATIONS = sorted(p.parent.relative_to(KUBE) for p in KUBE.rglob("kustomization.yaml"))
WORKLOADS = sorted(
    [
        Path("base/sidecar"),
        Path("base/daemonset"),
        *(p for p in KUSTOMIZATIONS if p.parts[0] == "overlays"),
    ]
)
ENGINES = ("dynamo", "vllm", "sglang")
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
K8S_VERSIONS = ("1.29.0", "latest")
"""Oldest Kubernetes the manifests target (native fields they use exist since 1.26)
and the newest schema the installed kubernetes-validate ships."""
DRAIN_MARGIN_S = 10
"""docs/operations.md promises at least this much between the drain and SIGKILL."""


# --- tools ----------------------------------------------------------------------------


def require_tool(name: str) -> str:
    """Path of an external tool; skip without it, but fail in CI."""
    found = shutil.which(name) or _beside_python(name)
    if found is not None:
        return found
    message = f"{name} is not installed (`make tools` installs checkov; .ci/run installs promtool)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def _beside_python(name: str) -> str | None:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.is_file() else None


def run_tool(
    args: list[str], *, cwd: Path = REPO, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


# --- a small kustomize ------------------------------------------------------------------

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches"}
"""What the renderer implements; a kustomization using more is an error here."""

Doc = dict[str, Any]


def load_docs(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def render(directory: Path) -> list[Doc]:
    """The documents `kustomize build directory` would produce (for the features used)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: the test renderer does not implement {sorted(unknown)}"
    docs: list[Doc] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else load_docs(path)
    for patch in spec.get("patches", []):
        assert set(patch) <= {"patch", "path"}, f"{directory}: unsupported patch options {patch}"
        body = (
            yaml.safe_load(patch["patch"])
            if "patch" in patch
            else load_docs(directory / patch["path"])[0]
        )
        index = _target(docs, body)
        docs[index] = strategic_merge(docs[index], body)
    return docs


def _identity(doc: Doc) -> tuple[str, str, str]:
    return doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]


def _target(docs: list[Doc], patch: Doc) -> int:
    matches = [i for i, doc in enumerate(docs) if _identity(doc) == _identity(patch)]
    assert len(matches) == 1, f"patch target {_identity(patch)} matched {len(matches)} documents"
    return matches[0]


def _keyed_by_name(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(item, dict) and "name" in item for item in items)


def strategic_merge(base: Any, patch: Any) -> Any:
    """Maps merge key by key; lists of named items merge by name (patch items first,
    then the base's others, as kustomize orders them); anything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            assert not key.startswith("$"), f"directive {key} is not implemented"
            merged[key] = strategic_merge(base[key], value) if key in base else value
        return merged
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and _keyed_by_name(base)
        and _keyed_by_name(patch)
    ):
        originals = {item["name"]: item for item in base}
        patched = [
            strategic_merge(originals[p["name"]], p) if p["name"] in originals else p for p in patch
        ]
        names = {p["name"] for p in patch}
        return patched + [item for item in base if item["name"] not in names]
    return copy.deepcopy(patch)


@pytest.mark.parametrize(
    ("base", "patch", "expected"),
    [
        ({"a": 1, "b": {"c": 2}}, {"b": {"d": 3}}, {"a": 1, "b": {"c": 2, "d": 3}}),
        ({"args": ["--x"]}, {"args": ["--y"]}, {"args": ["--y"]}),
        (
            [{"name": "a", "v": 1}, {"name": "b", "v": 2}],
            [{"name": "b", "v": 3}, {"name": "c", "v": 4}],
            [{"name": "b", "v": 3}, {"name": "c", "v": 4}, {"name": "a", "v": 1}],
        ),
        ([{"port": 1}], [{"port": 2}], [{"port": 2}]),
    ],
)
def test_strategic_merge(base: Any, patch: Any, expected: Any) -> None:
    assert strategic_merge(base, patch) == expected


def test_renderer_rejects_features_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("namePrefix: x-\nresources: []\n")
    with pytest.raises(AssertionError, match="namePrefix"):
        render(tmp_path)


@functools.cache
def _rendered(path: Path) -> tuple[Doc, ...]:
    return tuple(render(KUBE / path))


def rendered(path: Path) -> list[Doc]:
    """Rendered once per run; callers get their own copy to poke at."""
    return copy.deepcopy(list(_rendered(path)))


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=str)
def test_renderer_agrees_with_kubectl_kustomize(path: Path) -> None:
    kubectl = require_tool("kubectl")
    result = run_tool([kubectl, "kustomize", str(KUBE / path)], timeout=60)
    assert result.returncode == 0, result.stderr
    theirs = {_identity(doc): doc for doc in yaml.safe_load_all(result.stdout) if doc}
    ours = {_identity(doc): doc for doc in rendered(path)}
    assert ours == theirs


def test_the_layouts_and_engines_are_all_there() -> None:
    overlays = {p for p in KUSTOMIZATIONS if p.parts[0] == "overlays"}
    assert overlays == {
        Path("overlays", e, layout) for e in ENGINES for layout in ("sidecar", "daemonset")
    }
    assert Path("monitoring") in KUSTOMIZATIONS


# --- Kubernetes schemas and CRDs --------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=str)
def test_manifests_validate_against_kubernetes_schemas(path: Path, version: str) -> None:
    import kubernetes_validate

    if version == "latest":
        version = kubernetes_validate.latest_version()
    docs = [d for d in rendered(path) if (d["apiVersion"], d["kind"]) not in CRD_KINDS]
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(
                f"{path} {_identity(doc)} on {version}: {error.message} at {list(error.path)}"
            )


def test_every_kind_is_known() -> None:
    kinds = {(d["apiVersion"], d["kind"]) for path in KUSTOMIZATIONS for d in rendered(path)}
    core = {
        ("v1", "ServiceAccount"),
        ("v1", "Service"),
        ("apps/v1", "Deployment"),
        ("apps/v1", "DaemonSet"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
    }
    assert kinds == core | CRD_KINDS


def test_prometheus_rule_carries_the_rules_file() -> None:
    (rule,) = [d for d in rendered(Path("monitoring")) if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"], (
        "monitoring/prometheusrule.yaml and prometheus/pylon-rules.yml differ"
    )


@pytest.mark.parametrize("path", WORKLOADS, ids=str)
def test_pod_monitor_scrapes_the_admin_port(path: Path) -> None:
    docs = rendered(path)
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    pod = workload(docs)["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert container_port(pylon_container(docs), endpoint["port"])["containerPort"] == ADMIN_PORT


# --- agreement with Settings ------------------------------------------------------------

DEFAULTS = Settings()
ADMIN_PORT = split_host_port(DEFAULTS.admin_listen)[1]
TUNNEL_PORT = split_host_port(DEFAULTS.listen)[1]


def workload(docs: list[Doc]) -> Doc:
    (found,) = [d for d in docs if d["kind"] in {"Deployment", "DaemonSet"}]
    return found


def containers(docs: list[Doc]) -> dict[str, Doc]:
    return {c["name"]: c for c in workload(docs)["spec"]["template"]["spec"]["containers"]}


def pylon_container(docs: list[Doc]) -> Doc:
    return containers(docs)["pylon"]


def container_port(container: Doc, name: str) -> Doc:
    (port,) = [p for p in container["ports"] if p["name"] == name]
    return port


def container_env(container: Doc) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        assert set(item) == {"name", "value"}, f"{item['name']}: secrets are files, not env"
        env[item["name"]] = item["value"]
    return env


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("PYLON_"):
            monkeypatch.delenv(name)
    return monkeypatch


def settings_from_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return load_settings(overrides={}, config_file=None)


def assert_starts_authenticated(settings: Settings) -> None:
    """Pylon refuses to start without tunnel auth outside --dev: every example must have it."""
    require_configured_auth(settings.auth, dev=settings.dev)
    assert not settings.dev and not settings.auth.insecure_no_auth
    assert settings.auth.client_ca_file is not None


def expected_backend(path: Path) -> str:
    return path.parts[1] if path.parts[0] == "overlays" else "passthrough"


@pytest.mark.parametrize("path", WORKLOADS, ids=str)
def test_pylon_env_loads_into_settings(path: Path, clean_env: pytest.MonkeyPatch) -> None:
    pylon = pylon_container(rendered(path))
    settings = settings_from_env(clean_env, container_env(pylon))
    assert_starts_authenticated(settings)
    mounted = [m["mountPath"] + "/" for m in pylon["volumeMounts"]]
    for needed in (settings.auth.client_ca_file, settings.tls.cert_file, settings.tls.key_file):
        assert any(str(needed).startswith(mount) for mount in mounted), needed
    assert settings.backend.type == expected_backend(path)
    assert settings.upstream.url is not None
    assert settings.tls.cert_file is not None and settings.tls.key_file is not None
    assert split_host_port(settings.listen) == ("0.0.0.0", TUNNEL_PORT)
    assert split_host_port(settings.admin_listen) == ("0.0.0.0", ADMIN_PORT)


@pytest.mark.parametrize("path", WORKLOADS, ids=str)
def test_ports_and_probes_match_settings(path: Path) -> None:
    docs = rendered(path)
    pylon = pylon_container(docs)
    tunnel = container_port(pylon, "tunnel")
    assert (tunnel["containerPort"], tunnel["protocol"]) == (TUNNEL_PORT, "UDP")
    admin = container_port(pylon, "admin")
    assert (admin["containerPort"], admin["protocol"]) == (ADMIN_PORT, "TCP")
    assert pylon["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert pylon["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "pylon"]
    (port,) = service["spec"]["ports"]
    assert (port["protocol"], port["port"], port["targetPort"]) == ("UDP", TUNNEL_PORT, "tunnel")
    pod_labels = workload(docs)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.parametrize("path", WORKLOADS, ids=str)
def test_grace_period_outlasts_the_drain(path: Path, clean_env: pytest.MonkeyPatch) -> None:
    docs = rendered(path)
    settings = settings_from_env(clean_env, container_env(pylon_container(docs)))
    grace = workload(docs)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > DEFAULTS.drain_grace_s
    assert grace >= settings.drain_grace_s + DRAIN_MARGIN_S


@pytest.mark.parametrize("path", [p for p in WORKLOADS if p.name == "sidecar"], ids=str)
def test_sidecar_engine_waits_for_pylon_and_matches_its_settings(
    path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    docs = rendered(path)
    settings = settings_from_env(clean_env, container_env(pylon_container(docs)))
    engine = containers(docs)["engine"]
    grace = workload(docs)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    script = engine["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert f"127.0.0.1:{ADMIN_PORT}/healthz" in script
    deadline = re.search(r"monotonic\(\) \+ (\d+)", script)
    assert deadline is not None
    assert settings.drain_grace_s < int(deadline[1]) < grace
    url = settings.upstream.url or ""
    assert url.startswith("http://127.0.0.1:")
    upstream_port = url.rpartition(":")[2]
    args = engine.get("args", [])
    assert any(arg.endswith(f"port={upstream_port}") for arg in args), args
    for flag, wanted in engine_flags(settings).items():
        assert (flag in args) == wanted, f"{flag} in engine args should be {wanted}"


def engine_flags(settings: Settings) -> dict[str, bool]:
    """Engine command-line flags that must agree with Pylon's backend settings."""
    backend = settings.backend
    if backend.type == "vllm":
        return {"--scheduling-policy=priority": True, "--host=127.0.0.1": True}
    if backend.type == "sglang":
        return {
            "--enable-priority-scheduling": backend.priority_scheduling,
            "--schedule-low-priority-values-first": backend.low_values_first,
            "--host=127.0.0.1": True,
        }
    if backend.type == "passthrough":
        return {"--host=127.0.0.1": True}
    return {}  # dynamo: the frontend's flags vary by release


@pytest.mark.parametrize("path", [p for p in WORKLOADS if p.name == "daemonset"], ids=str)
def test_daemonset_runs_on_gpu_nodes_and_stays_on_the_node(
    path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    docs = rendered(path)
    pod = workload(docs)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    settings = settings_from_env(clean_env, container_env(pylon_container(docs)))
    (engine_service,) = [d for d in docs if d["metadata"]["name"] == "engine-local"]
    assert engine_service["spec"]["internalTrafficPolicy"] == "Local"
    (port,) = engine_service["spec"]["ports"]
    assert settings.upstream.url == f"http://engine-local:{port['port']}"


# --- security posture (checkov scans too; these say what the manifests promise) --------


@pytest.mark.parametrize("path", WORKLOADS, ids=str)
def test_pods_are_locked_down(path: Path) -> None:
    docs = rendered(path)
    pod = workload(docs)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] >= 10000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["capabilities"] == {"drop": ["ALL"]}, container["name"]
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][bound]), container["name"]
        container_env(container)  # no secretKeyRef / valueFrom anywhere


@pytest.mark.parametrize("path", WORKLOADS, ids=str)
def test_tls_comes_from_a_mounted_secret(path: Path) -> None:
    docs = rendered(path)
    env = container_env(pylon_container(docs))
    volumes = {v["name"]: v for v in workload(docs)["spec"]["template"]["spec"]["volumes"]}
    mounts = pylon_container(docs)["volumeMounts"]
    for variable in ("PYLON_TLS__CERT_FILE", "PYLON_TLS__KEY_FILE"):
        file = Path(env[variable])
        (mount,) = [m for m in mounts if file.parent == Path(m["mountPath"])]
        assert mount.get("readOnly") is True
        assert volumes[mount["name"]]["secret"]["secretName"] == "pylon-tls"


def test_every_checkov_skip_is_justified() -> None:
    skips = []
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            text = path.read_text()
            skips += re.findall(r"checkov\.io/skip\d+:\s*(.*)", text)
            skips += re.findall(r"checkov:skip=(.*)", text)
    for skip in skips:
        assert re.fullmatch(r"CKV2?_[A-Z0-9_]+\s*[=:]\s*\S.{20,}", skip.strip()), skip


def test_checkov_passes_on_sources_and_rendered_manifests(tmp_path: Path) -> None:
    checkov = require_tool("checkov")
    for path in KUSTOMIZATIONS:
        (tmp_path / f"{'-'.join(path.parts)}.yaml").write_text(yaml.safe_dump_all(rendered(path)))
    reports = _checkov(checkov, DEPLOY, tmp_path)
    failures = [
        f"{r['check_id']} {r['resource']} {r['file_path']}"
        for report in reports
        for r in report["results"].get("failed_checks", [])
    ]
    assert not failures, "\n".join(failures)
    scanned = {
        kind: max(r["summary"]["resource_count"] for r in reports if r["check_type"] == kind)
        for kind in ("dockerfile", "kubernetes")
    }
    assert scanned["dockerfile"] >= 1
    assert scanned["kubernetes"] >= sum(len(rendered(path)) for path in KUSTOMIZATIONS)


def test_checkov_catches_an_unsafe_pod(tmp_path: Path) -> None:
    """The negative control: the scan above passing means something."""
    checkov = require_tool("checkov")
    deployment = copy.deepcopy(workload(rendered(Path("base/sidecar"))))
    deployment["metadata"].pop("annotations")
    pylon = deployment["spec"]["template"]["spec"]["containers"][1]
    pylon["securityContext"] = {"privileged": True}
    (tmp_path / "unsafe.yaml").write_text(yaml.safe_dump(deployment))
    reports = _checkov(checkov, tmp_path)
    failed = {
        r["check_id"] for report in reports for r in report["results"].get("failed_checks", [])
    }
    assert {"CKV_K8S_16", "CKV_K8S_22"} <= failed  # privileged, writable root filesystem


def _checkov(checkov: str, *directories: Path) -> list[Doc]:
    args = [checkov, "--framework", "kubernetes", "dockerfile", "--compact", "--skip-download"]
    for directory in directories:
        args += ["-d", str(directory)]
    result = run_tool([*args, "--quiet", "-o", "json"])
    assert result.returncode in (0, 1), result.stderr[-2000:]
    reports: list[Doc] = []
    decoder, text, at = json.JSONDecoder(), result.stdout, 0
    while text[at:].strip():  # one JSON document per directory scanned
        value, at = decoder.raw_decode(text, at + len(text[at:]) - len(text[at:].lstrip()))
        reports += value if isinstance(value, list) else [value]
    return reports


# --- Dockerfile -------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for word, args in self.instructions if word == keyword]

    def one(self, keyword: str) -> str:
        (args,) = self.all(keyword)
        return args


def dockerfile_stages(text: str) -> list[Stage]:
    """Stages of a Dockerfile: continuation lines joined, comments dropped."""
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            base, _, name = args.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip() or None))
        else:
            stages[-1].instructions.append((keyword, args))
    return stages


def _logical_lines(text: str) -> Iterator[str]:
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        yield pending + line
        pending = ""


STAGES = dockerfile_stages(DOCKERFILE.read_text())
BUILDER, RUNTIME = STAGES[0], STAGES[-1]


def key_values(args: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(args))


def test_dockerfile_is_multi_stage_on_slim_python() -> None:
    assert len(STAGES) == 2
    assert BUILDER.name == "builder"
    assert {stage.base for stage in STAGES} == {"python:3.11-slim"}
    assert any("pip install -c requirements.lock ." in run for run in BUILDER.all("RUN"))
    assert "--from=builder /opt/pylon /opt/pylon" in RUNTIME.all("COPY")


def test_dockerfile_runs_as_non_root() -> None:
    user = RUNTIME.one("USER").split(":")
    assert user[0] not in {"0", "root"} and int(user[0]) >= 10000
    (useradd,) = [run for run in RUNTIME.all("RUN") if "useradd" in run]
    assert f"--uid {user[0]}" in useradd
    for path in WORKLOADS:  # the manifests run the image as the same user
        pod = workload(rendered(path))["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == int(user[0]), path


def test_dockerfile_ports_entrypoint_and_env_match_settings(clean_env: pytest.MonkeyPatch) -> None:
    assert set(RUNTIME.one("EXPOSE").split()) == {f"{TUNNEL_PORT}/udp", f"{ADMIN_PORT}/tcp"}
    assert json.loads(RUNTIME.one("ENTRYPOINT")) == ["pylon", "serve"]
    env = {k: v for args in RUNTIME.all("ENV") for k, v in key_values(args).items()}
    pylon_env = {k: v for k, v in env.items() if k.startswith("PYLON_")}
    assert pylon_env == {
        "PYLON_LISTEN": f"0.0.0.0:{TUNNEL_PORT}",
        "PYLON_ADMIN_LISTEN": f"0.0.0.0:{ADMIN_PORT}",
    }
    settings = settings_from_env(clean_env, pylon_env)
    assert settings.listen == f"0.0.0.0:{TUNNEL_PORT}"
    assert RUNTIME.one("STOPSIGNAL") == "SIGTERM"


def test_dockerfile_has_oci_labels() -> None:
    labels = {k: v for args in RUNTIME.all("LABEL") for k, v in key_values(args).items()}
    for name in ("title", "description", "version", "revision", "created"):
        assert labels.get(f"org.opencontainers.image.{name}"), name


def test_docker_context_holds_what_pip_install_needs() -> None:
    ignore = [
        line.strip() for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    ]
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    entries = [line for line in ignore if line and not line.startswith("#")]
    assert entries[0] == "*"  # everything else stays out: .git, .venv, tests, caches
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in patterns if (REPO / p.rstrip("*")).is_dir()}
    assert packages and packages <= kept
    assert {"pyproject.toml", "requirements.lock", project["project"]["readme"]} <= kept


def _healthcheck_command() -> list[str]:
    _, _, command = RUNTIME.one("HEALTHCHECK").partition("CMD ")
    argv = json.loads(command)
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False), (None, False)])
def test_healthcheck_command_probes_healthz(status: int | None, healthy: bool) -> None:
    assert DEFAULTS.admin_listen.rpartition(":")[2] in RUNTIME.one("HEALTHCHECK")
    handler = type("Health", (_Health,), {"status": status or 200})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        if status is not None:
            thread.start()
        env = {"PATH": os.environ.get("PATH", ""), "PYLON_ADMIN_LISTEN": f"0.0.0.0:{port}"}
        if status is None:
            server.server_close()  # nothing listens on the port any more
        result = subprocess.run(_healthcheck_command(), env=env, capture_output=True, timeout=30)
        if status is not None:
            server.shutdown()
            thread.join()
    assert (result.returncode == 0) == healthy, result.stderr


# --- config examples --------------------------------------------------------------------

CONFIG_FILES = sorted((DEPLOY / "config").glob("*.toml"))


def test_there_is_a_config_example_per_backend() -> None:
    assert {p.stem for p in CONFIG_FILES} == {"passthrough", *ENGINES}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_example_loads(path: Path, clean_env: pytest.MonkeyPatch) -> None:
    settings = load_settings(overrides={}, config_file=path)
    assert_starts_authenticated(settings)
    assert settings.backend.type == path.stem
    assert split_host_port(settings.listen)[1] == TUNNEL_PORT
    assert split_host_port(settings.admin_listen)[1] == ADMIN_PORT
    assert settings.tls.cert_file is not None and settings.upstream.url is not None


def env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, value = line.partition("=")
            assert sep and name.startswith("PYLON_") and not value.startswith(('"', "'")), line
            env[name] = value
    return env


def test_env_file_example_loads(clean_env: pytest.MonkeyPatch) -> None:
    env = env_file(DEPLOY / "config" / "pylon.env")
    settings = settings_from_env(clean_env, env)
    assert_starts_authenticated(settings)
    assert settings.backend.type == env["PYLON_BACKEND__TYPE"]
    assert settings.model_dump()["backend"].get("strict_tier_bands")
    assert settings.drain_grace_s == float(env["PYLON_DRAIN_GRACE_S"])


def test_a_bad_key_in_a_config_example_would_fail(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG_FILES[0].read_text().replace("[upstream]", "[upstream]\nurll = 'x'"))
    with pytest.raises(ValueError, match="urll"):
        load_settings(overrides={}, config_file=bad)


# --- alert rules ------------------------------------------------------------------------

RULES = [
    rule for group in yaml.safe_load(RULES_FILE.read_text())["groups"] for rule in group["rules"]
]
ALERTS = {rule["alert"]: rule for rule in RULES}
SEVERITIES = {
    "PylonEngineNotReady": "warning",
    "PylonHigh5xxRatio": "critical",
    "PylonUpstreamErrors": "warning",
    "PylonSpoofAttempts": "info",
    "PylonRequestRejectionsSpike": "warning",
    "PylonNoTraffic": "warning",
    "PylonQueuedBytesHigh": "warning",
    "PylonWorkerRestarts": "warning",
    "PylonWorkersNotSteered": "warning",
}


def test_alerts_and_severities() -> None:
    assert {name: rule["labels"]["severity"] for name, rule in ALERTS.items()} == SEVERITIES


def test_alerts_use_metrics_pylon_declares() -> None:
    declared = set()
    for source in (REPO / "pylon").glob("*.py"):
        declared |= set(re.findall(r"\"(pylon_[a-z0-9_]+)\"", source.read_text()))
    for name, rule in ALERTS.items():
        used = set(re.findall(r"\bpylon_[a-z0-9_]+", rule["expr"]))
        assert used and used <= declared, f"{name} uses undeclared {used - declared}"


def test_every_alert_has_a_runbook() -> None:
    headings = set(re.findall(r"^### (\w+)$", OPERATIONS_MD.read_text(), flags=re.MULTILINE))
    for name, rule in ALERTS.items():
        assert name in headings, f"docs/operations.md has no runbook section for {name}"
        assert rule["annotations"]["runbook_url"] == f"docs/operations.md#{name.lower()}"
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_promtool_checks_rules_and_scrape_config() -> None:
    promtool = require_tool("promtool")
    rules = run_tool([promtool, "check", "rules", str(RULES_FILE)])
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = run_tool([promtool, "check", "config", str(PROMETHEUS_CONFIG)])
    assert config.returncode == 0, config.stdout + config.stderr


A = {"job": "pylon", "instance": "a:9464", "backend": "vllm"}
B = {"job": "pylon", "instance": "b:9464", "backend": "vllm"}
C = {"job": "pylon", "instance": "c:9464", "backend": "vllm"}


@dataclass(frozen=True)
class AlertCase:
    """Input series (1-minute samples) and the alerts expected at one time."""

    alert: str
    series: tuple[tuple[str, dict[str, str], str], ...]
    """(metric, labels, promtool values) per series."""
    eval_time: str
    firing: tuple[dict[str, str], ...]
    """Labels of each alert expected to fire (severity is added from the rule)."""


def _series(
    metric: str, labels: dict[str, str], values: str, **extra: str
) -> tuple[str, dict[str, str], str]:
    return metric, {**labels, **extra}, values


REQ = "pylon_requests_total"
REJ = "pylon_requests_rejected_total"
ALERT_CASES = [
    *(
        AlertCase(
            "PylonEngineNotReady",
            (_series("pylon_engine_ready", A, "0x30"), _series("pylon_engine_ready", B, "1x30")),
            time,
            firing,
        )
        for time, firing in (("5m", ()), ("15m", (A,)))
    ),
    *(
        AlertCase(
            "PylonHigh5xxRatio",
            (
                _series(REQ, A, "0+60x30", route="chat", status_class="2xx"),
                _series(REQ, A, "0+6x30", route="chat", status_class="5xx"),  # 9 %
                _series(REQ, B, "0+60x30", route="chat", status_class="2xx"),
                _series(REQ, B, "0+2x30", route="chat", status_class="5xx"),  # 3 %
            ),
            time,
            firing,
        )
        for time, firing in (("5m", ()), ("20m", (A,)))
    ),
    AlertCase(
        "PylonUpstreamErrors",
        (
            _series("pylon_upstream_errors_total", A, "0+12x30", kind="connect"),  # 0.2/s
            _series("pylon_upstream_errors_total", B, "0+3x30", kind="timeout"),  # 0.05/s
        ),
        "20m",
        (A,),
    ),
    *(
        AlertCase(
            "PylonSpoofAttempts",
            (
                _series(
                    "pylon_stripped_total", A, "0 0 0 1x10", kind="header", name="x-priority-x"
                ),
                _series("pylon_stripped_total", B, "0x13", kind="header", name="x-priority-x"),
            ),
            time,
            firing,
        )
        for time, firing in (
            ("2m", ()),
            ("5m", ({**A, "kind": "header", "name": "x-priority-x"},)),
        )
    ),
    AlertCase(
        "PylonRequestRejectionsSpike",
        (
            _series(REQ, A, "0+120x30", route="chat", status_class="4xx"),  # 2/s
            _series(REJ, A, "0+30x30", reason="body_invalid"),  # 0.5/s: 25 %
            _series(REQ, B, "0+120x30", route="chat", status_class="4xx"),
            _series(REJ, B, "0x30", reason="body_invalid"),
            _series(REJ, B, "0+60x30", reason="draining"),  # not counted
            _series(REQ, C, "0+6x30", route="chat", status_class="4xx"),  # 0.1/s
            _series(REJ, C, "0+3x30", reason="body_invalid"),  # 50 %, but 0.05/s
        ),
        "20m",
        (A,),
    ),
    *(
        AlertCase(
            "PylonNoTraffic",
            (
                _series(REQ, A, "0x70", route="chat", status_class="2xx"),
                _series("pylon_engine_ready", A, "1x70"),
                _series(REQ, B, "0+10x70", route="chat", status_class="2xx"),
                _series("pylon_engine_ready", B, "1x70"),
                _series(REQ, C, "0x70", route="chat", status_class="2xx"),
                _series("pylon_engine_ready", C, "0x70"),
            ),
            time,
            firing,
        )
        for time, firing in (("30m", ()), ("60m", (A,)))
    ),
    *(
        AlertCase(
            "PylonQueuedBytesHigh",
            (
                _series("pylon_queued_response_bytes", A, "300000000x20"),
                _series("pylon_queued_response_bytes", B, "100000000x20"),
            ),
            time,
            firing,
        )
        for time, firing in (("5m", ()), ("15m", (A,)))
    ),
    *(
        AlertCase(
            "PylonWorkerRestarts",
            (
                _series("pylon_worker_restarts_total", A, "0x5 1 2 3 4x20", reason="crashed"),
                _series("pylon_worker_restarts_total", B, "0x10 1x20", reason="unresponsive"),
                _series("pylon_worker_restarts_total", B, "0x10 1x20", reason="crashed"),
            ),
            time,
            firing,
        )
        for time, firing in (("6m", ()), ("12m", (A,)), ("25m", ()))
    ),
    *(
        AlertCase(
            "PylonWorkersNotSteered",
            (
                _series("pylon_workers_steered", A, "0x20"),
                _series("pylon_workers_steered", B, "1x20"),
            ),
            time,
            firing,
        )
        for time, firing in (("3m", ()), ("10m", (A,)))
    ),
]


def _expand(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m[1], ""), template)


def _promtool_test(case: AlertCase) -> Doc:
    rule = ALERTS[case.alert]
    assert "$value" not in json.dumps(rule["annotations"]), "annotations use only $labels"
    return {
        "interval": "1m",
        "name": f"{case.alert} at {case.eval_time}",
        "input_series": [
            {
                "series": metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}",
                "values": values,
            }
            for metric, labels, values in case.series
        ],
        "alert_rule_test": [
            {
                "eval_time": case.eval_time,
                "alertname": case.alert,
                "exp_alerts": [
                    {
                        "exp_labels": {**labels, **rule["labels"]},
                        "exp_annotations": {
                            k: _expand(v, labels) for k, v in rule["annotations"].items()
                        },
                    }
                    for labels in case.firing
                ],
            }
        ],
    }


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    for name in ALERTS:
        cases = [case for case in ALERT_CASES if case.alert == name]
        assert any(case.firing for case in cases), f"{name} never fires in ALERT_CASES"
        instances = {labels["instance"] for case in cases for _, labels, _ in case.series}
        fired = {labels["instance"] for case in cases for labels in case.firing}
        assert instances - fired, f"{name} has no healthy series that must stay quiet"


def test_alerts_fire_on_bad_traces_only(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    tests = {
        "rule_files": [str(RULES_FILE)],
        "evaluation_interval": "1m",
        "tests": [_promtool_test(case) for case in ALERT_CASES],
    }
    test_file = tmp_path / "pylon-rules.test.yml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run_tool([promtool, "test", "rules", str(test_file)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
