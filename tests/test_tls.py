"""TLS on both listeners of a real `lantau serve`: the official openai client over HTTPS and
tritonclient's gRPC over TLS, trusting a test CA (trustme); plain HTTP and insecure gRPC
refused; with --ssl-ca-certs only clients holding a certificate that CA signed get in (mutual
TLS); files that do not load stop the start, named."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest
import tritonclient.grpc as grpcclient
import trustme

from tests.servers import free_port

MODEL = "random:tiny"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the server's certificate for 127.0.0.1, and a client's, as PEM files."""
    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("support-bot@example.com")
    files = {
        "ca": ca.cert_pem, "key": server.private_key_pem, "cert": server.cert_chain_pems[0],
        "client_key": client.private_key_pem, "client_cert": client.cert_chain_pems[0],
    }  # fmt: skip
    for name, blob in files.items():
        blob.write_to_path(str(folder / f"{name}.pem"))
    return {name: str(folder / f"{name}.pem") for name in files}


def trusting(pki: dict, with_client_cert: bool = False) -> ssl.SSLContext:
    """A client's TLS context trusting the test CA (and presenting the client's certificate)."""
    context = ssl.create_default_context(cafile=pki["ca"])
    if with_client_cert:
        context.load_cert_chain(pki["client_cert"], pki["client_key"])
    return context


class TlsServer:
    def __init__(self, pki: dict, mutual: bool = False) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.base = f"https://127.0.0.1:{self.port}"
        extra = ["--ssl-ca-certs", pki["ca"]] if mutual else []
        cmd = [
            sys.executable, "-m", "lantau.cli", "serve", MODEL, "--device", "cpu",
            "--port", str(self.port), "--grpc-port", str(self.grpc_port),
            "--max-model-len", "256", "--num-kv-blocks", "64",
            "--ssl-keyfile", pki["key"], "--ssl-certfile", pki["cert"], *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)  # fmt: skip
        self.http = httpx.Client(verify=trusting(pki, mutual), timeout=30)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stdout.read())
            try:
                if self.http.get(f"{self.base}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.close()
        raise TimeoutError("server did not become ready")

    def close(self) -> str:
        self.http.close()
        self.proc.kill()
        return self.proc.communicate(timeout=30)[0]


@pytest.fixture(scope="module")
def tls_server(pki):
    server = TlsServer(pki)
    yield server
    server.close()


def test_https_and_grpc_over_tls(tls_server, pki):
    client = openai.OpenAI(base_url=f"{tls_server.base}/v1", api_key="x",
                           http_client=httpx.Client(verify=trusting(pki)))  # fmt: skip
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
        httpx.get(f"http://127.0.0.1:{tls_server.port}/health", timeout=5)
    grpc = grpcclient.InferenceServerClient(
        f"127.0.0.1:{tls_server.grpc_port}", ssl=True, root_certificates=pki["ca"]
    )
    assert grpc.is_server_live() and grpc.is_server_ready()
    insecure = grpcclient.InferenceServerClient(f"127.0.0.1:{tls_server.grpc_port}")
    with pytest.raises(Exception, match="(?i)unavailable|ssl|handshake|socket closed"):
        insecure.is_server_live(client_timeout=5)


def test_mutual_tls_wants_a_client_certificate(pki):
    server = TlsServer(pki, mutual=True)
    try:
        assert server.http.get(f"{server.base}/health").status_code == 200  # with its cert
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server.base}/health", verify=trusting(pki), timeout=5)  # without
        grpc = grpcclient.InferenceServerClient(
            f"127.0.0.1:{server.grpc_port}", ssl=True, root_certificates=pki["ca"],
            private_key=pki["client_key"], certificate_chain=pki["client_cert"],
        )  # fmt: skip
        assert grpc.is_server_live()
        bare = grpcclient.InferenceServerClient(
            f"127.0.0.1:{server.grpc_port}", ssl=True, root_certificates=pki["ca"]
        )
        with pytest.raises(Exception, match="(?i)unavailable|ssl|handshake|socket closed"):
            bare.is_server_live(client_timeout=5)
    finally:
        out = server.close()
    assert f"on https://127.0.0.1:{server.port}" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs needs --ssl-keyfile"),
        (["--ssl-keyfile", "no.pem", "--ssl-certfile", "no.pem"], "--ssl-certfile / --ssl-keyfile"),
    ],
)
def test_bad_tls_files_stop_the_start(flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "lantau.cli", "serve", MODEL, *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_gateway_over_tls_to_tls_replicas(tls_server, pki):
    """`lantau route` with its own certificate, in front of a TLS replica found by DNS
    (`localhost`: its certificate checked against that name, though the gateway connects to
    the address) and its gRPC port over TLS: the official clients through it over TLS."""
    port, grpc_port = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "lantau.cli", "route", "--port", str(port),
        "--grpc-port", str(grpc_port), "--health-interval", "0.3",
        "--backend-dns", f"localhost:{tls_server.port}",
        "--grpc-backend", f"127.0.0.1:{tls_server.grpc_port}", "--backend-tls",
        "--backend-ca-certs", pki["ca"], "--ssl-keyfile", pki["key"], "--ssl-certfile", pki["cert"],
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"https://127.0.0.1:{port}"
    try:
        http = httpx.Client(verify=trusting(pki), timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if http.get(f"{base}/v1/models").json()["data"]:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", http_client=http)
        r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
        grpc = grpcclient.InferenceServerClient(
            f"127.0.0.1:{grpc_port}", ssl=True, root_certificates=pki["ca"]
        )
        assert grpc.is_server_ready() and grpc.is_model_ready(MODEL)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert f"on https://127.0.0.1:{port}" in out, out


def test_gateway_refuses_tls_files_that_do_not_load(pki):
    for flags, message in (
        (["--backend-ca-certs", "no.pem"], "--backend-ca-certs"),
        (["--backend-certfile", pki["client_cert"]], "--backend-certfile and --backend-keyfile"),
        (["--ssl-keyfile", pki["key"]], "--ssl-keyfile and --ssl-certfile go together"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "lantau.cli", "route", "--backend", "http://127.0.0.1:9",
             *flags], capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_bench_serve_against_an_https_server(tls_server, pki, tmp_path):
    """`lantau bench serve --url https://...` with the server's CA (or --insecure) runs; with
    neither, the certificate is refused at its first request."""
    from lantau.cli import main

    flags = ["bench", "serve", "--url", tls_server.base, "--workload", "random:8/4",
             "--num-requests", "4", "--vocab-size", "500", "--disable-tqdm"]  # fmt: skip
    assert main([*flags, "--ssl-ca-certs", pki["ca"], "--out", str(tmp_path / "a")]) == 0
    result = json.loads((tmp_path / "a" / "results.json").read_text())
    assert result["summary"]["num_completed"] == 4
    assert main([*flags, "--insecure"]) == 0
    assert main(flags) != 0


def test_rollback_reaches_an_https_server(tls_server, pki, capsys):
    """`lantau rollback --url https://... --ssl-ca-certs CA` gets through TLS to the server's
    answer (here: no repository to roll back); without the CA the certificate is refused."""
    from lantau.cli import main

    flags = ["rollback", "llama", "--url", tls_server.base, "--timeout", "10"]
    assert main([*flags, "--ssl-ca-certs", pki["ca"]]) == 1
    answered = capsys.readouterr().err
    assert main(flags) == 1
    refused = capsys.readouterr().err
    assert "CERTIFICATE_VERIFY_FAILED" not in answered and "lantau rollback: 4" in answered
    assert "CERTIFICATE_VERIFY_FAILED" in refused
