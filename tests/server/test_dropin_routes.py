"""What a llama.cpp or vLLM user switching servers meets first: every OpenAI route also without `/v1` (the
`openai` SDK with a base_url lacking it), `x-api-key` as good as `Authorization: Bearer`, CORS from
`--cors-origins` (preflights answered before the key check, headers exposed, credentials never with `*`)
and HTTPS from `--ssl-keyfile/--ssl-certfile` on a real `cellserve serve` with a certificate made here."""

import datetime
import ipaddress
import ssl
import time

import httpx
import openai
import pytest
from browser_support import ServeProcess
from http_support import API_KEY, LiveServer

PAGE = "http://127.0.0.1:5173"  # a web front-end's origin (another port is another origin)


@pytest.fixture(scope="module")
def srv(model_dir):
    with LiveServer(model_dir, api_key=API_KEY, cors_origins=[PAGE]) as server:
        yield server


def test_openai_sdk_without_v1_gets_the_v1_answers(srv):
    bare = openai.OpenAI(base_url=srv.url, api_key=API_KEY, max_retries=0)
    v1 = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    assert bare.chat.completions.create(**chat).choices[0].message.content == \
        v1.chat.completions.create(**chat).choices[0].message.content
    text = {"model": "m", "prompt": "abc", "max_tokens": 6, "temperature": 0}
    assert bare.completions.create(**text).choices[0].text == v1.completions.create(**text).choices[0].text
    assert [m.id for m in bare.models.list()] == [m.id for m in v1.models.list()] == ["tiny-llama"]
    stored = bare.responses.create(model="m", input="hi", max_output_tokens=4, temperature=0)
    assert bare.responses.retrieve(stored.id).output_text == v1.responses.retrieve(stored.id).output_text
    streamed = "".join(c.choices[0].delta.content or "" for c in bare.chat.completions.create(**chat, stream=True)
                       if c.choices)
    assert streamed == v1.chat.completions.create(**chat).choices[0].message.content


def test_routes_without_v1_keep_the_key_and_the_rest_404(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get("/models").status_code == 401  # the /v1 route's own guard
        assert c.get("/models", headers={"x-api-key": API_KEY}).status_code == 200
        assert c.get("/models", headers={"x-api-key": "wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"x-api-key": API_KEY}).json()["data"][0]["id"] == "tiny-llama"
        assert c.get("/modelsx", headers={"x-api-key": API_KEY}).status_code == 404  # a segment, not a prefix
        assert c.get("/sequences", headers={"x-api-key": API_KEY}).status_code == 404  # cellserve's own: /v1 only


def test_cors_preflight_and_exposed_headers(srv):
    asks = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        pre = c.options("/v1/chat/completions", headers=asks)  # no key: a preflight never carries one
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == PAGE
        assert pre.headers["access-control-allow-credentials"] == "true"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        assert c.options("/chat/completions", headers=asks).status_code == 200  # the alias too
        other = c.options("/v1/chat/completions", headers={**asks, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body,
                      headers={"Origin": PAGE, "Authorization": f"Bearer {API_KEY}"}) as r:
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
            assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
            assert r.headers["x-request-id"].startswith("chatcmpl-")
            r.read()
        denied = c.post("/v1/chat/completions", json=body, headers={"Origin": PAGE})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == PAGE


def test_no_cors_by_default_and_wildcard_without_credentials(model_dir):
    from server.middleware import cors_options

    wild = cors_options(["*"])
    assert wild["allow_origins"] == ["*"] and wild["allow_credentials"] is False
    with LiveServer(model_dir) as plain, httpx.Client(base_url=plain.url, timeout=30) as c:
        pre = c.options("/v1/models", headers={"Origin": PAGE, "Access-Control-Request-Method": "GET"})
        assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
        got = c.get("/v1/models", headers={"Origin": PAGE})
        assert got.status_code == 200 and "access-control-allow-origin" not in got.headers
        paths = c.get("/openapi.json").json()["paths"]
        assert "/v1/chat/completions" in paths and "/chat/completions" not in paths


def _self_signed(tmp_path):
    """A key and a certificate for 127.0.0.1, made now (cryptography), valid for a day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_file, cert_file = tmp_path / "key.pem", tmp_path / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


def test_serve_over_tls_with_cors_and_x_api_key(model_dir, tmp_path):
    key_file, cert_file = _self_signed(tmp_path)
    args = ["--model", model_dir, "--dtype", "float32", "--n-cells", "512", "--no-warmup", "--api-key", "k",
            "--ssl-keyfile", key_file, "--ssl-certfile", cert_file, "--cors-origins", "*"]
    with ServeProcess(args, tmp_path / "serve.log") as proc:
        url = proc.url.replace("http://", "https://")
        with httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=cert_file), timeout=30) as c:
            for _ in range(1200):
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            assert c.get("/health").status_code == 200
            pre = c.options("/completions", headers={"Origin": "https://any.example",
                                                      "Access-Control-Request-Method": "POST"})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
            assert "access-control-allow-credentials" not in pre.headers
            got = c.post("/completions", headers={"x-api-key": "k"},
                         json={"model": "m", "prompt": "abc", "max_tokens": 3, "temperature": 0})
            assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is refused by a verifying client
            httpx.get(url + "/health", timeout=10)
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port gets no answer
            httpx.get(proc.url + "/health", timeout=10)
