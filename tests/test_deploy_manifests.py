"""The deployment files (deploy/, compose.yaml, Containerfile) checked offline: every Kubernetes
manifest against the Kubernetes API's schemas (the ``kubernetes-validate`` package, strict: an
unknown field is an error), every KServe object against KServe's CRD schemas (tests/schemas/kserve,
copied from KServe; unknown fields made errors the same way), compose.yaml with ``compose-spec``,
the node and gateway files embedded in ConfigMaps with xlaserve's own loaders, and the Grafana
dashboard's queries against the metrics the server really exports. Deliberate typos must fail."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from compose_spec import PyCompose
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.test_docs_audit import _metric_names
from xlaserve.config import load_node_config
from xlaserve.config.gateway import load_gateway_file

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KSERVE_SCHEMAS = Path(__file__).resolve().parent / "schemas" / "kserve"
# The oldest Kubernetes the manifests are written for (policy/v1 PDBs, StatefulSet
# podManagementPolicy, appProtocol on Service ports are all older than this).
K8S_VERSION = "1.30"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def manifests() -> list[tuple[str, dict]]:
    """Every object of every deploy/k8s file, as (``file#index kind/name``, object)."""
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                found.append((f"{path.name}#{i} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}", doc))
    return found


def by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def one(kind: str, name: str) -> dict:
    (doc,) = [doc for doc in by_kind(kind) if doc["metadata"]["name"] == name]
    return doc


# --- KServe: the CRD schemas, made strict ---------------------------------------------------------

def _strict(schema: object) -> object:
    """The CRD schema with unknown fields rejected, as the API server's strict field validation
    (``kubectl apply --validate=strict``) does: every object schema that lists its properties and
    does not preserve unknown fields gets ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) if key not in ("enum", "default", "example") else value
           for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def _k8s_definitions() -> dict:
    folder = f"kubernetes-json-schema/v{_schema_version()}-local-strict/_definitions.json"
    return kubernetes_validate.utils.schema_contents(folder, K8S_VERSION)


@cache
def _schema_version() -> str:
    return [v for v in kubernetes_validate.utils.all_versions()
            if kubernetes_validate.utils.major_minor(v) == K8S_VERSION][-1]


@cache
def _kserve_validators() -> dict[tuple[str, str], jsonschema.Validator]:
    """(apiVersion, kind) -> a validator of the whole object: the CRD's schema, strict, with
    ``metadata`` checked against Kubernetes' ObjectMeta (a CRD schema leaves it open)."""
    definitions = Resource.from_contents(_k8s_definitions(), default_specification=DRAFT202012)
    registry = definitions @ Registry()        # by its $id, https://kubernetes.io/api/_definitions.json
    validators = {}
    for path in sorted(KSERVE_SCHEMAS.glob("*.json")):
        crd = json.loads(path.read_text())
        schema = _strict(crd["openAPIV3Schema"])
        schema["properties"]["metadata"] = {"$ref": f"{_k8s_definitions()['$id']}#/$defs/{OBJECT_META}"}
        schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata", "spec"})
        schema["properties"]["apiVersion"] = {"const": f"{crd['group']}/{crd['version']}"}
        schema["properties"]["kind"] = {"const": crd["kind"]}
        validators[(f"{crd['group']}/{crd['version']}", crd["kind"])] = (
            jsonschema.Draft202012Validator(schema, registry=registry))
    return validators


def validation_errors(doc: dict) -> list[str]:
    """Why ``doc`` is not a valid object of its kind (empty when it is). A kind with no schema
    at all is an error too, so a manifest cannot pass by naming something unknown."""
    api = doc.get("apiVersion", "")
    if api.startswith("serving.kserve.io/"):
        validator = _kserve_validators().get((api, doc.get("kind")))
        if validator is None:
            return [f"no KServe schema for {api} {doc.get('kind')} (tests/schemas/kserve has "
                    f"{sorted(_kserve_validators())})"]
        return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                for e in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path)) or '(top)'}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [exc.message]
    return []


@pytest.mark.parametrize("where, doc", manifests(), ids=[where for where, _ in manifests()])
def test_every_manifest_validates(where, doc):
    assert validation_errors(doc) == []


def test_the_manifests_hold_what_the_issue_asks_for():
    kinds = {(doc["apiVersion"], doc["kind"]) for _, doc in manifests()}
    assert {("apps/v1", "StatefulSet"), ("apps/v1", "Deployment"), ("v1", "Service"),
            ("v1", "ConfigMap"), ("policy/v1", "PodDisruptionBudget"),
            ("serving.kserve.io/v1alpha1", "ServingRuntime"),
            ("serving.kserve.io/v1beta1", "InferenceService")} <= kinds


def _typo(doc: dict, path: tuple, new_key: str) -> dict:
    """``doc`` with the key at ``path`` renamed to ``new_key``."""
    broken = copy.deepcopy(doc)
    parent = broken
    for step in path[:-1]:
        parent = parent[step]
    parent[new_key] = parent.pop(path[-1])
    return broken


TYPOS = [
    # (kind, name, path of the key to misspell, misspelling)
    ("StatefulSet", "xlaserve-node", ("spec", "template", "spec", "containers", 0, "readinessProbe"), "readynessProbe"),
    ("StatefulSet", "xlaserve-node", ("spec", "template", "spec", "containers", 0, "resources", "limits"), "limit"),
    ("Deployment", "xlaserve-gateway", ("spec", "template", "spec", "terminationGracePeriodSeconds"), "terminationGracePeriod"),
    ("Service", "xlaserve-workers", ("spec", "clusterIP"), "clusterIp"),
    ("PodDisruptionBudget", "xlaserve-node", ("spec", "maxUnavailable"), "maxUnavailible"),
    ("NetworkPolicy", "xlaserve-node", ("spec", "policyTypes"), "policyType"),
    ("ServingRuntime", "xlaserve", ("spec", "protocolVersions"), "protocolVersion"),
    ("ServingRuntime", "xlaserve", ("spec", "containers", 0, "readinessProbe"), "readinesProbe"),
    ("InferenceService", "xlaserve-examples", ("spec", "predictor", "model", "storageUri"), "storageURI"),
    ("InferenceService", "xlaserve-examples", ("metadata", "annotations"), "anotations"),
]


@pytest.mark.parametrize("kind, name, path, misspelt", TYPOS, ids=[t[3] for t in TYPOS])
def test_a_misspelt_field_fails(kind, name, path, misspelt):
    doc = one(kind, name)
    assert validation_errors(doc) == []
    errors = validation_errors(_typo(doc, path, misspelt))
    assert errors, f"{kind}/{name} with {path[-1]} misspelt as {misspelt} validated"
    assert any(misspelt in error for error in errors), errors


def test_a_wrong_type_fails():
    statefulset = copy.deepcopy(one("StatefulSet", "xlaserve-node"))
    statefulset["spec"]["replicas"] = "two"
    assert validation_errors(statefulset)
    runtime = copy.deepcopy(one("ServingRuntime", "xlaserve"))
    runtime["spec"]["containers"][0]["ports"][0]["containerPort"] = "8001"
    assert validation_errors(runtime)


def test_an_unknown_kind_fails():
    assert validation_errors({"apiVersion": "apps/v1", "kind": "StatefulSett", "metadata": {"name": "x"}})
    assert validation_errors({"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceServce",
                              "metadata": {"name": "x"}, "spec": {}})


# --- what the manifests say, checked against each other and against xlaserve ----------------------

def _configmap_file(tmp_path: Path, configmap: str, key: str) -> Path:
    path = tmp_path / key
    path.write_text(one("ConfigMap", configmap)["data"][key])
    return path


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _pod(kind: str, name: str) -> dict:
    return one(kind, name)["spec"]["template"]


def _container_port(container: dict, port: str | int) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def test_the_node_configmap_is_a_valid_node_file_that_the_pods_serve(tmp_path):
    node = load_node_config(_configmap_file(tmp_path, "xlaserve-node", "node.yaml"), {})
    assert node.gpus == "auto" and node.runtime.backend == "cuda"
    pod = _pod("StatefulSet", "xlaserve-node")
    (container,) = pod["spec"]["containers"]
    # the node file is the one mounted and passed to `xlaserve run`
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "node-file"]
    assert container["args"] == [f"{mount['mountPath']}/node.yaml"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "node-file"]
    assert volume["configMap"]["name"] == "xlaserve-node"
    # the model repository is the read-only volume at model_repo
    (models,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
    assert Path(models["mountPath"]) == node.model_repo and models["readOnly"] is True
    # one GPU a pod; probes on the node's HTTP port: readiness /readyz, liveness /healthz
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert _container_port(container, container[probe]["httpGet"]["port"]) == _port(node.listen.http)
    assert _container_port(container, "grpc") == _port(node.listen.grpc)
    # the drain (30 s in the worker, supervisor.stop_timeout_seconds in a supervisor) fits the grace period
    assert pod["spec"]["terminationGracePeriodSeconds"] > node.supervisor.stop_timeout_seconds
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_the_gateway_finds_the_workers_through_the_headless_service(tmp_path):
    gateway = load_gateway_file(_configmap_file(tmp_path, "xlaserve-gateway", "gateway.yaml"), {})
    service = one("Service", "xlaserve-workers")
    assert service["spec"]["clusterIP"] == "None"
    statefulset = one("StatefulSet", "xlaserve-node")
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    grpc_port = [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"][0]
    dns = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:{grpc_port}"
    assert gateway.endpoints == (dns,)
    # and the Service's grpc port reaches the node's gRPC port
    node = load_node_config(_configmap_file(tmp_path, "xlaserve-node", "node.yaml"), {})
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    target = [p["targetPort"] for p in service["spec"]["ports"] if p["name"] == "grpc"][0]
    assert _container_port(container, target) == _port(node.listen.grpc)
    # the gateway's pods are started with the mounted file
    pod = _pod("Deployment", "xlaserve-gateway")
    (gw,) = pod["spec"]["containers"]
    (mount,) = gw["volumeMounts"]
    assert gw["command"] == ["xlaserve", "gateway", f"{mount['mountPath']}/gateway.yaml"]
    assert _container_port(gw, gw["readinessProbe"]["httpGet"]["port"]) == _port(gateway.listen.metrics)
    # clients reach the gateway's REST port through the Service xlaserve
    rest = [p for p in one("Service", "xlaserve")["spec"]["ports"] if p["name"] == "rest"][0]
    assert _container_port(gw, rest["targetPort"]) == _port(gateway.listen.rest) == rest["port"]


def test_every_service_and_budget_selects_pods(tmp_path):
    pods = [_pod("StatefulSet", "xlaserve-node")["metadata"]["labels"],
            _pod("Deployment", "xlaserve-gateway")["metadata"]["labels"]]
    for service in by_kind("Service"):
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pods), service["metadata"]["name"]
    for budget in by_kind("PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert any(selector.items() <= labels.items() for labels in pods), budget["metadata"]["name"]
    policy = one("NetworkPolicy", "xlaserve-node")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pods[0].items()
    (node,) = _pod("StatefulSet", "xlaserve-node")["spec"]["containers"]
    port_names = {p["name"] for p in node["ports"]}
    for rule in policy["ingress"]:
        assert {p["port"] for p in rule["ports"]} <= port_names
        for source in rule["from"]:
            if "podSelector" in source:       # the gateway's pods may reach the workers' gRPC
                assert source["podSelector"]["matchLabels"].items() <= pods[1].items()
    namespaces = {doc["metadata"].get("namespace") for _, doc in manifests() if doc["kind"] != "Namespace"}
    assert namespaces == {one("Namespace", "xlaserve")["metadata"]["name"]}


def test_the_serving_runtime_speaks_grpc_v2_on_the_nodes_port():
    runtime = one("ServingRuntime", "xlaserve")
    isvc = one("InferenceService", "xlaserve-examples")
    assert runtime["spec"]["protocolVersions"] == ["grpc-v2", "v2"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["protocolVersion"] == "grpc-v2"
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    node = load_node_config(ROOT / "deploy" / "node.yaml", {})
    (container,) = runtime["spec"]["containers"]
    h2c, rest = container["ports"]      # the first is the predictor Service's: gRPC, as the model asks
    assert h2c["name"] == "h2c" and h2c["containerPort"] == _port(node.listen.grpc)
    assert rest["containerPort"] == _port(node.listen.rest)
    assert container["readinessProbe"]["httpGet"]["port"] == _port(node.listen.http)
    # the image's node file serves KServe's model directory through the environment override
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["INFERENCE_SERVER_MODEL_REPO"] == "/mnt/models"
    assert load_node_config(ROOT / "deploy" / "node.yaml", env).model_repo == Path("/mnt/models")


# --- the image's own files ------------------------------------------------------------------------

def test_the_images_node_file_loads_and_the_containerfile_can_set_its_backend():
    node = load_node_config(ROOT / "deploy" / "node.yaml", {})
    assert node.model_repo == Path("/models") and node.gpus == "auto" and node.runtime.backend == "cpu"
    assert not node.endpoints.allow_client_shm
    # the Containerfile's sed rewrites exactly this line for VARIANT=cuda
    text = (ROOT / "deploy" / "node.yaml").read_text()
    assert len(re.findall(r"^    backend: cpu\b", text, re.MULTILINE)) == 1
    cuda = re.sub(r"^(    backend:) cpu\b", r"\1 cuda", text, flags=re.MULTILINE)
    assert yaml.safe_load(cuda)["global"]["runtime"]["backend"] == "cuda"


def test_the_containerfile_runs_the_node_as_a_user_with_a_healthcheck():
    text = (ROOT / "Containerfile").read_text()
    assert re.search(r"^ARG BASE=\S+", text, re.MULTILINE)
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) >= 3          # python base, build, runtime
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["xlaserve", "run"\]', text, re.MULTILINE)
    assert re.search(r'^CMD \["/etc/xlaserve/node.yaml"\]', text, re.MULTILINE)
    assert "HEALTHCHECK" in text and "deploy/healthcheck.py" in text
    # the build context lets in what the Containerfile copies
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.MULTILINE):
        for item in source.split():
            assert f"!{item.rstrip('/')}" in ignore, f".dockerignore keeps {item} out of the build context"


def _containerfile_run_text() -> str:
    """The Containerfile as its parser reads RUN lines: a backslash-newline joins two lines."""
    return (ROOT / "Containerfile").read_text().replace("\\\n", "")


def test_the_containerfile_installs_the_otel_extra_unless_told_not_to():
    text = _containerfile_run_text()
    assert re.search(r"^ARG TRACING=otel$", (ROOT / "Containerfile").read_text(), re.MULTILINE)
    # the requirements step's own Python, run on this pyproject.toml for each VARIANT and TRACING
    (script,) = re.findall(r"python3 -c '(import sys, tomllib;[^']*)'\s+\"\$VARIANT\" \"\$TRACING\"", text)
    script = script.replace("/tmp/pyproject.toml", str(ROOT / "pyproject.toml"))

    def requirements(variant: str, tracing: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", script, variant, tracing], capture_output=True, text=True,
                              check=True)
        return done.stdout.splitlines()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    otel, cuda = project["optional-dependencies"]["otel"], project["optional-dependencies"]["cuda"]
    assert any(d.startswith("opentelemetry-sdk") for d in otel)
    assert any(d.startswith("opentelemetry-exporter-otlp-proto-http") for d in otel)
    assert requirements("cpu", "otel") == project["dependencies"] + otel
    assert requirements("cpu", "none") == project["dependencies"]
    assert requirements("cuda", "otel") == project["dependencies"] + cuda + otel
    assert requirements("cuda", "none") == project["dependencies"] + cuda
    # the wheel is installed with the same extras, and the build fails if the exporter does not import
    (extras_line,) = re.findall(r"extras=\$\(.*?\| paste -sd, -\)", text)
    for variant, tracing, expected in (("cpu", "otel", "otel"), ("cpu", "none", ""), ("cuda", "otel", "cuda,otel"),
                                       ("cuda", "none", "cuda")):
        done = subprocess.run(["sh", "-c", f'{extras_line}; printf %s "$extras"'], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", "VARIANT": variant, "TRACING": tracing}, check=True)
        assert done.stdout == expected, (variant, tracing, done.stdout)
    assert 'if [ -n "$extras" ]; then spec="xlaserve[$extras] @ file://$wheel"' in text
    assert re.search(r'if \[ "\$TRACING" = otel \]; then /opt/xlaserve/bin/python -c '
                     r'\'import opentelemetry\.sdk\.trace; '
                     r'from opentelemetry\.exporter\.otlp\.proto\.http\.trace_exporter import OTLPSpanExporter\'', text)
    assert 'case "$TRACING" in otel|none) ;;' in text


def test_tracing_is_shown_off_in_every_node_and_gateway_file_and_the_environment_turns_it_on(tmp_path):
    on = {"INFERENCE_SERVER_TRACING_ENABLED": "true"}
    # the image's node file: off, OTLP; the variables of its comment turn it on and point it elsewhere
    image = load_node_config(ROOT / "deploy" / "node.yaml", {})
    assert not image.tracing.enabled and image.tracing.exporter == "otlp"
    text = (ROOT / "deploy" / "node.yaml").read_text()
    variables = dict(re.findall(r"^#\s+-e (INFERENCE_SERVER_TRACING_\w+)=(\S+)$", text, re.MULTILINE))
    assert variables == {**on, "INFERENCE_SERVER_TRACING_OTLP_ENDPOINT": "http://collector:4318/v1/traces"}
    traced = load_node_config(ROOT / "deploy" / "node.yaml", variables).tracing
    assert traced.enabled and traced.otlp_endpoint == "http://collector:4318/v1/traces"
    # Kubernetes: the node and gateway ConfigMaps export to the same collector, off until enabled
    node = load_node_config(_configmap_file(tmp_path, "xlaserve-node", "node.yaml"), {})
    gateway = load_gateway_file(_configmap_file(tmp_path, "xlaserve-gateway", "gateway.yaml"), {})
    collector = "http://otel-collector.observability.svc.cluster.local:4318/v1/traces"
    for tracing in (node.tracing, gateway.tracing):
        assert not tracing.enabled and tracing.exporter == "otlp" and tracing.otlp_endpoint == collector
    assert node.tracing.sampling_ratio == gateway.tracing.sampling_ratio == 0.05
    assert load_node_config(_configmap_file(tmp_path, "xlaserve-node", "node.yaml"), on).tracing.enabled
    assert load_gateway_file(_configmap_file(tmp_path, "xlaserve-gateway", "gateway.yaml"),
                             {"INFERENCE_SERVER_GATEWAY_TRACING_ENABLED": "true"}).tracing.enabled
    # the node ConfigMap's comment names a variable that exists, in the form Kubernetes expands
    configmap_text = (K8S / "node.yaml").read_text()
    assert '{name: INFERENCE_SERVER_TRACING_OTLP_ENDPOINT, value: "http://$(HOST_IP):4318/v1/traces"}' in configmap_text
    assert "{name: HOST_IP, valueFrom: {fieldRef: {fieldPath: status.hostIP}}}" in configmap_text
    # KServe's ServingRuntime sets both through the environment of the image's node file
    (container,) = one("ServingRuntime", "xlaserve")["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    runtime = load_node_config(ROOT / "deploy" / "node.yaml", env).tracing
    assert not runtime.enabled and runtime.otlp_endpoint == collector
    assert load_node_config(ROOT / "deploy" / "node.yaml", {**env, **on}).tracing.enabled
    # compose: XLASERVE_TRACING turns it on, XLASERVE_OTLP_ENDPOINT points it
    def compose_node_env(environ: dict[str, str]) -> dict[str, str]:
        return yaml.safe_load(interpolated((ROOT / "compose.yaml").read_text(), environ))["services"]["node"]["environment"]
    assert not load_node_config(ROOT / "deploy" / "node.yaml", compose_node_env({})).tracing.enabled
    node_env = compose_node_env({"XLASERVE_TRACING": "true", "XLASERVE_OTLP_ENDPOINT": "http://jaeger:4318/v1/traces"})
    traced = load_node_config(ROOT / "deploy" / "node.yaml", node_env).tracing
    assert traced.enabled and traced.otlp_endpoint == "http://jaeger:4318/v1/traces"


# --- compose and the dashboard --------------------------------------------------------------------

def compose() -> dict:
    return yaml.safe_load(interpolated((ROOT / "compose.yaml").read_text(), {}))


def interpolated(text: str, environ: dict[str, str]) -> str:
    """compose's variable interpolation, which happens before the file is parsed: ``${NAME}``,
    ``${NAME:-default}`` (default when unset or empty), ``${NAME-default}`` (when unset) and
    ``$$``. Other forms are not used in compose.yaml, and are an error here."""
    def one_variable(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.group("name"), match.group("op"), match.group("default") or ""
        if name is None:
            raise ValueError(f"compose.yaml: unsupported interpolation {match.group(0)!r}")
        value = environ.get(name)
        if op == ":-":
            return value or default
        if op == "-":
            return default if value is None else value
        return value or ""
    return re.sub(r"\$\$|\$\{(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?)?\}?",
                  one_variable, text)


def test_compose_is_a_valid_compose_file():
    text = (ROOT / "compose.yaml").read_text()
    PyCompose.from_yaml(interpolated(text, {})).validate()
    PyCompose.from_yaml(interpolated(text, {"XLASERVE_MODELS": "/srv/models", "BASE": "localhost/debian:bookworm-min"})).validate()
    assert "/srv/models:/models:ro" in interpolated(text, {"XLASERVE_MODELS": "/srv/models"})


def test_a_compose_typo_fails():
    text = interpolated((ROOT / "compose.yaml").read_text(), {})
    assert "stop_grace_period:" in text
    with pytest.raises(ValueError, match="stop_grace_periode"):
        PyCompose.from_yaml(text.replace("stop_grace_period:", "stop_grace_periode:", 1)).validate()
    with pytest.raises(ValueError, match="duration"):
        PyCompose.from_yaml(text.replace("stop_grace_period: 45s", "stop_grace_period: 45 seconds", 1)).validate()


def test_compose_wires_the_node_prometheus_and_grafana():
    services = compose()["services"]
    assert set(services) == {"node", "prometheus", "grafana"}
    node = load_node_config(ROOT / "deploy" / "node.yaml", {})
    # every published port is on loopback
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert f"127.0.0.1:{_port(node.listen.grpc)}:{_port(node.listen.grpc)}" in services["node"]["ports"]
    assert f"127.0.0.1:{_port(node.listen.rest)}:{_port(node.listen.rest)}" in services["node"]["ports"]
    # Prometheus scrapes the node's HTTP port by its service name
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"node:{_port(node.listen.http)}"]
    # every file mounted from the repository exists
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./deploy"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is missing"
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def dashboard() -> dict:
    return json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "xlaserve.json").read_text())


def dashboard_exprs() -> Iterator[str]:
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]


def _exported(name: str, names: set[str]) -> bool:
    """Whether a series name in a query is exported: a family, a counter's ``_total``, or a
    histogram's ``_bucket``/``_sum``/``_count``."""
    if name in names:
        return True
    base, _, suffix = name.rpartition("_")
    return suffix in ("bucket", "sum", "count") and base in names


def test_the_dashboard_queries_only_metrics_the_server_exports():
    names = _metric_names()
    used = {m for expr in dashboard_exprs() for m in re.findall(r"\bxlaserve_[a-z_]+", expr)}
    assert used, "the dashboard queries nothing"
    missing = sorted(m for m in used if not _exported(m, names))
    assert missing == []
    # the check itself catches a misspelt metric
    assert not _exported("xlaserve_request_duration_second_bucket", names)
    assert not _exported("xlaserve_queue_dept", names)


def test_the_dashboard_has_the_panels_an_operator_needs():
    exprs = list(dashboard_exprs())
    datasource_uid = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"][0]["uid"]

    def queried(metric: str) -> bool:
        return any(re.search(rf"\b{metric}\b", expr) for expr in exprs)
    assert queried("xlaserve_requests_total")                            # throughput per model
    assert any("histogram_quantile(0.99" in e and "xlaserve_request_duration_seconds_bucket" in e for e in exprs)
    assert queried("xlaserve_queue_depth")
    assert queried("xlaserve_batch_rows_sum") and queried("xlaserve_batch_rows_count")   # rows per execution
    assert queried("xlaserve_weight_cache_model_resident_bytes")        # residency
    assert queried("xlaserve_weight_cache_model_load_seconds_count")    # weight loads
    assert queried("xlaserve_rejections_total")
    for panel in dashboard()["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == datasource_uid
