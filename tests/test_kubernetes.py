"""deploy/kubernetes/ checked without a cluster: every resource against Kubernetes' own schemas
(kubernetes-validate, strict: a misspelt field fails), and against lantau itself: the
containers' arguments parse with lantau's CLI, the probes ask routes that answer without an API
key, the gateway finds the replicas through the headless Service it names, and each pod's
grace period outlasts its drain."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from lantau.cli import make_parser
from lantau.server.app import OPEN_PATHS

KUBE = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.32.0"


def resources() -> list[dict]:
    listed = yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(
        p.name for p in KUBE.glob("*.yaml") if p.stem != "kustomization"
    )
    return [doc for name in listed for doc in yaml.safe_load_all((KUBE / name).read_text())]


def by_kind_and_name() -> dict[tuple[str, str], dict]:
    return {(r["kind"], r["metadata"]["name"]): r for r in resources()}


@pytest.mark.parametrize(
    "resource", resources(), ids=lambda r: f"{r['kind']}/{r['metadata']['name']}"
)
def test_valid_against_the_kubernetes_schemas(resource):
    kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_the_validator_bites():
    deployment = copy.deepcopy(by_kind_and_name()[("Deployment", "lantau-replica")])
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 90  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def container(name: str) -> dict:
    pod = by_kind_and_name()[("Deployment", name)]["spec"]["template"]["spec"]
    (only,) = pod["containers"]
    return only


def parsed_args(name: str):
    return make_parser().parse_args(container(name)["args"])


def test_arguments_are_lantaus_own():
    serve, route = parsed_args("lantau-replica"), parsed_args("lantau-gateway")
    assert serve.command == "serve" and serve.model_control_mode == "poll"
    assert route.command == "route" and route.backend_dns and not route.backend
    assert route.grpc_backend_dns and route.grpc_port


def test_probes_and_ports():
    for name in ("lantau-replica", "lantau-gateway"):
        c = container(name)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        args = parsed_args(name)
        assert ports["http"] == args.port and ports["grpc"] == args.grpc_port
        assert args.host == "0.0.0.0"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check = c.get(probe, {}).get("httpGet")
            if check is not None:  # asked without a key: open routes only
                assert check["path"] in OPEN_PATHS and check["port"] in ports
    replica = container("lantau-replica")
    assert replica["resources"]["limits"]["nvidia.com/gpu"] == 1
    # the gateway is not restarted for its replicas being down: its liveness is not /health
    assert "httpGet" not in container("lantau-gateway")["livenessProbe"]


def test_the_gateway_finds_the_replicas_through_the_headless_service():
    (entry,) = parsed_args("lantau-gateway").backend_dns
    host, port = entry.rsplit(":", 1)
    service = by_kind_and_name()[("Service", host.split(".")[0])]
    assert service["spec"]["clusterIP"] == "None"  # DNS answers with the pods' addresses
    replica_labels = by_kind_and_name()[("Deployment", "lantau-replica")]["spec"]["template"][
        "metadata"
    ]["labels"]
    assert service["spec"]["selector"].items() <= replica_labels.items()
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert http["port"] == int(port) == parsed_args("lantau-replica").port
    (grpc_entry,) = parsed_args("lantau-gateway").grpc_backend_dns
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc_entry == f"{host}:{grpc['port']}" and grpc["targetPort"] == "grpc"
    assert grpc["port"] == parsed_args("lantau-replica").grpc_port
    front = by_kind_and_name()[("Service", "lantau")]
    assert front["spec"]["selector"]["app.kubernetes.io/name"] == "lantau-gateway"


def test_grace_periods_outlast_the_drains():
    for name in ("lantau-replica", "lantau-gateway"):
        pod = by_kind_and_name()[("Deployment", name)]["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > parsed_args(name).drain_timeout + 5
    rollout = by_kind_and_name()[("Deployment", "lantau-replica")]["spec"]["strategy"]
    assert rollout["rollingUpdate"]["maxUnavailable"] == 0  # a new replica is up first
