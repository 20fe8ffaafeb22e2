import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.tools.conftest import LoopbackServer, Reply
from tools.net import guarded_client
from tools.ssrf import BlockedURL, SSRFGuard

pytestmark = pytest.mark.integration


def client_for(guard: SSRFGuard) -> httpx.AsyncClient:
    return guarded_client(guard, timeout=5, user_agent="test-agent")


async def test_connects_to_the_vetted_address_keeping_the_host_name(site: LoopbackServer) -> None:
    site.routes["/"] = Reply(200, b"hi")
    answers = [["127.0.0.1"], ["127.0.0.2"]]  # a rebinding server would answer differently the second time
    calls: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return answers[min(len(calls) - 1, 1)]

    guard = SSRFGuard(allow_networks=["127.0.0.1/32"], resolver=resolve)
    async with client_for(guard) as client:
        # "rebind.test" exists only in our resolver: reaching the site proves the connection used its answer.
        response = await client.get(f"http://rebind.test:{site.port}/")
    assert response.text == "hi"
    assert calls == ["rebind.test"]
    method, path, headers = site.received[0]
    assert headers["Host"] == f"rebind.test:{site.port}" and headers["User-Agent"] == "test-agent"


async def test_the_transport_refuses_without_any_precheck(trap: LoopbackServer) -> None:
    async with client_for(SSRFGuard(allow_networks=["127.0.0.1/32"])) as client:
        with pytest.raises(BlockedURL, match=f"refused {trap.url('/secret')}: 127.0.0.2 is a loopback address"):
            await client.get(trap.url("/secret"))
        with pytest.raises(BlockedURL, match="only http and https URLs may be fetched"):
            await client.get("file:///etc/passwd")
    assert trap.received == []


async def test_a_name_resolving_to_a_refused_address_is_refused(trap: LoopbackServer) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.2"]

    async with client_for(SSRFGuard(resolver=resolve)) as client:
        with pytest.raises(BlockedURL, match="innocent.test resolves to 127.0.0.2, a loopback address"):
            await client.get(f"http://innocent.test:{trap.port}/")
    assert trap.received == []


async def test_environment_proxies_are_ignored(site: LoopbackServer, monkeypatch: pytest.MonkeyPatch) -> None:
    site.routes["/"] = Reply(200, b"direct")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    async with client_for(SSRFGuard(allow_hosts=[f"127.0.0.1:{site.port}"])) as client:
        assert (await client.get(site.url())).text == "direct"


async def test_redirects_are_not_followed_by_the_client(site: LoopbackServer) -> None:
    site.routes["/go"] = Reply(302, headers={"Location": "/there"})
    async with client_for(SSRFGuard(allow_hosts=[f"127.0.0.1:{site.port}"])) as client:
        response = await client.get(site.url("/go"))
    assert response.status_code == 302 and site.paths() == ["/go"]


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for secure.test (made with the openssl command)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=secure.test",
                    "-addext", "subjectAltName=DNS:secure.test"], check=True, capture_output=True)
    return cert, key


async def test_tls_uses_the_host_name_for_sni_and_verification(site: LoopbackServer,
                                                               certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    site.routes["/"] = Reply(200, b"secret-free")
    server_names: list[str | None] = []
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    server_context.sni_callback = lambda sock, name, ctx: server_names.append(name)
    site.wrap(server_context)

    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    guard = SSRFGuard(allow_networks=["127.0.0.1/32"], resolver=resolve)
    client_context = ssl.create_default_context(cafile=str(cert))
    async with guarded_client(guard, timeout=5, user_agent="t", ssl_context=client_context) as client:
        response = await client.get(f"https://secure.test:{site.port}/")
        assert response.text == "secret-free"
        # The certificate names secure.test, not the address connected to: the check must fail for the IP.
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED|IP address mismatch"):
            await client.get(f"https://127.0.0.1:{site.port}/")
    assert server_names[0] == "secure.test"
