"""deploy/helm/lantau checked without a cluster: `helm lint`, then what `helm template` renders
(with the default values and with others) against Kubernetes' own schemas (kubernetes-validate,
strict: a misspelt field fails) and against lantau itself: the containers' arguments parse with
lantau's CLI, the probes ask routes that answer without an API key, the gateways find the
replicas through the headless Service they name, each pod's grace period outlasts its drain."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from lantau.cli import make_parser
from lantau.server.app import OPEN_PATHS

CHART = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "lantau"
KUBERNETES_VERSION = "1.32.0"
# values beside the defaults: no gateway, two GPUs a replica, a claim of the user's own
VARIANT = [
    "--set", "gateway.enabled=false", "--set", "replicas.gpus=2",
    "--set", "modelRepository.existingClaim=models", "--set", "scrapeAnnotations=false",
]  # fmt: skip


def helm() -> str:
    path = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")
    if path is None:
        pytest.fail("helm is not installed: `make helm` puts it in the venv")
    return path


@functools.cache
def render(*flags: str) -> tuple[dict, ...]:
    done = subprocess.run(
        [helm(), "template", "lantau", str(CHART), *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def named(docs, kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(docs, name: str) -> dict:
    (only,) = named(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
    return only


def parsed_args(docs, name: str):
    return make_parser().parse_args(container(docs, name)["args"])


def test_lint():
    done = subprocess.run([helm(), "lint", str(CHART)], capture_output=True, text=True)
    assert done.returncode == 0 and "0 chart(s) failed" in done.stdout, done.stdout


TLS = ("--set", "tls.secretName=lantau-tls")


@pytest.mark.parametrize("flags", [(), tuple(VARIANT), TLS], ids=["defaults", "variant", "tls"])
def test_valid_against_the_kubernetes_schemas(flags):
    docs = render(*flags)
    assert len(docs) >= 4
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_bites():
    deployment = copy.deepcopy(named(render(), "Deployment", "lantau-replica"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 90  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_arguments_are_lantaus_own():
    docs = render()
    serve, route = parsed_args(docs, "lantau-replica"), parsed_args(docs, "lantau-gateway")
    assert serve.command == "serve" and serve.model_repository == "/models"
    assert serve.model_control_mode == "poll"  # the values' extraArgs
    assert route.command == "route" and route.backend_dns and not route.backend
    assert route.grpc_backend_dns and route.grpc_port and route.policy == "least-loaded"


def test_probes_ports_and_gpus():
    docs = render()
    for name in ("lantau-replica", "lantau-gateway"):
        c = container(docs, name)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        args = parsed_args(docs, name)
        assert ports["http"] == args.port and ports["grpc"] == args.grpc_port
        assert args.host == "0.0.0.0"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check = c.get(probe, {}).get("httpGet")
            if check is not None:  # asked without a key: open routes only
                assert check["path"] in OPEN_PATHS and check["port"] in ports
    # the gateway is not restarted for its replicas being down: its liveness is not /health
    assert "httpGet" not in container(docs, "lantau-gateway")["livenessProbe"]
    assert container(docs, "lantau-replica")["resources"]["limits"]["nvidia.com/gpu"] == 1
    variant = render(*VARIANT)
    assert container(variant, "lantau-replica")["resources"]["limits"] == {
        "memory": "64Gi", "nvidia.com/gpu": 2,
    }  # fmt: skip


def test_the_gateways_find_the_replicas_through_the_headless_service():
    docs = render()
    route, serve = parsed_args(docs, "lantau-gateway"), parsed_args(docs, "lantau-replica")
    (http_entry,), (grpc_entry,) = route.backend_dns, route.grpc_backend_dns
    host = http_entry.rsplit(":", 1)[0]
    service = named(docs, "Service", host)
    assert service["spec"]["clusterIP"] == "None"  # DNS answers with the pods' addresses
    labels = named(docs, "Deployment", "lantau-replica")["spec"]["template"]["metadata"]
    assert service["spec"]["selector"].items() <= labels["labels"].items()
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert http_entry == f"{host}:{ports['http']['port']}" and ports["http"]["port"] == serve.port
    assert grpc_entry == f"{host}:{ports['grpc']['port']}"
    assert ports["grpc"]["port"] == serve.grpc_port
    front = named(docs, "Service", "lantau")
    assert front["spec"]["selector"]["app.kubernetes.io/name"] == "lantau-gateway"
    # without gateways, clients' Service points at the replicas, and the claim is the user's
    variant = render(*VARIANT)
    assert named(variant, "Service", "lantau")["spec"]["selector"] == service["spec"]["selector"]
    assert not [d for d in variant if d["kind"] == "PersistentVolumeClaim"]
    volumes = named(variant, "Deployment", "lantau-replica")["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["persistentVolumeClaim"]["claimName"] == "models"


def test_grace_periods_outlast_the_drains():
    docs = render()
    for name in ("lantau-replica", "lantau-gateway"):
        pod = named(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > parsed_args(docs, name).drain_timeout + 5
    rollout = named(docs, "Deployment", "lantau-replica")["spec"]["strategy"]
    assert rollout["rollingUpdate"]["maxUnavailable"] == 0  # a new replica is up first


def test_tls_from_a_secret():
    """tls.secretName: every pod mounts the Secret; the replicas and the gateways serve TLS
    with its tls.key / tls.crt (lantau's own flags, parsed), the gateways reach the replicas
    over TLS against its ca.crt, the probes and the scrape annotations say https; without it
    none of that."""
    docs = render(*TLS)
    serve, route = parsed_args(docs, "lantau-replica"), parsed_args(docs, "lantau-gateway")
    for args in (serve, route):
        assert args.ssl_keyfile == "/etc/lantau/tls/tls.key"
        assert args.ssl_certfile == "/etc/lantau/tls/tls.crt"
    assert route.backend_tls and route.backend_ca_certs == "/etc/lantau/tls/ca.crt"
    for name in ("lantau-replica", "lantau-gateway"):
        pod = named(docs, "Deployment", name)["spec"]["template"]
        c = container(docs, name)
        assert {"name": "tls", "mountPath": "/etc/lantau/tls", "readOnly": True} in c[
            "volumeMounts"
        ]
        assert {"name": "tls", "secret": {"secretName": "lantau-tls"}} in pod["spec"]["volumes"]
        checks = [c[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
                  if "httpGet" in c.get(p, {})]  # fmt: skip
        assert checks and all(check["scheme"] == "HTTPS" for check in checks)
        assert pod["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    plain = render()
    assert parsed_args(plain, "lantau-replica").ssl_certfile is None
    assert not parsed_args(plain, "lantau-gateway").backend_tls
    assert container(plain, "lantau-replica")["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
