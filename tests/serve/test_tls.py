"""HTTPS (vLLM's --ssl-certfile / --ssl-keyfile): the API answers over TLS with the given certificate, plain HTTP
gets no answer, and a bad pair is refused before the model loads."""
from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import sys

import httpx
import openai
import pytest
from serve_helpers import Server

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a certificate")


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return str(cert), str(key)


def test_the_api_answers_over_https_only(pem):
    cert, key = pem
    trust = ssl.create_default_context(cafile=cert)
    server = Server("--max-model-len", "512", "--ssl-certfile", cert, "--ssl-keyfile", key, tls=trust)
    try:
        assert server.url.startswith("https://")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(verify=trust, timeout=120))
        out = client.chat.completions.create(model=client.models.list().data[0].id, max_completion_tokens=4,
                                             messages=[{"role": "user", "content": "Hi"}])
        assert out.usage.completion_tokens >= 1 and out.choices[0].message.content
        with pytest.raises(httpx.HTTPError):  # a plain-HTTP request gets no HTTP answer
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # nor does a client that does not trust the certificate
            httpx.get(server.url + "/health", timeout=10)
    finally:
        server.stop()


@pytest.mark.parametrize("which, message", [
    ("cert only", "HTTPS needs both --ssl-certfile and --ssl-keyfile"),
    ("missing key", "--ssl-keyfile .*nope.pem: no such file"),
    ("key as cert", "not a PEM certificate and its private key"),
])
def test_a_bad_pair_is_refused_before_the_model_loads(pem, which: str, message: str):
    cert, key = pem
    flags = {"cert only": ["--ssl-certfile", cert], "missing key": ["--ssl-certfile", cert, "--ssl-keyfile", "nope.pem"],
             "key as cert": ["--ssl-certfile", key, "--ssl-keyfile", key]}[which]
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--port", "1", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert re.search(message, done.stderr), done.stderr
