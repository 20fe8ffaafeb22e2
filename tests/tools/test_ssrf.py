import asyncio
import ipaddress

import pytest

from tools.spec import ToolError
from tools.ssrf import BlockedURL, SSRFGuard, classify, parse_ip


def resolver_for(table: dict[str, list[str]]):
    calls: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        if host not in table:
            raise OSError("Name or service not known")
        return table[host]

    resolve.calls = calls  # type: ignore[attr-defined]
    return resolve


@pytest.mark.parametrize("host, expected", [
    ("127.0.0.1", "127.0.0.1"),
    ("2130706433", "127.0.0.1"),
    ("0x7f000001", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),
    ("127.1", "127.0.0.1"),
    ("[::1]", "::1"),
    ("::ffff:127.0.0.1", "::ffff:7f00:1"),
    ("example.com", None),
    ("cafe", None),
    ("1.2.3.4.5", None),
])
def test_parse_ip_reads_numeric_forms_like_the_resolver(host: str, expected: str | None) -> None:
    ip = parse_ip(host)
    assert (str(ip) if ip else None) == expected


@pytest.mark.parametrize("address, reason", [
    ("127.0.0.2", "loopback"),
    ("::1", "loopback"),
    ("10.1.2.3", "private"),
    ("172.16.0.1", "private"),
    ("192.168.1.1", "private"),
    ("fc00::1", "private"),
    ("169.254.1.1", "link-local"),
    ("fe80::1", "link-local"),
    ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("240.0.0.1", "reserved"),
    ("100.64.0.1", "non-public"),
    ("169.254.169.254", "cloud metadata"),
    ("fd00:ec2::254", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"),
    ("192.0.0.192", "cloud metadata"),
    ("::ffff:127.0.0.1", "loopback address (inside ::ffff:7f00:1)"),
    ("::ffff:169.254.169.254", "cloud metadata"),
    ("2002:7f00:1::", "loopback"),  # 6to4 carrying 127.0.0.1
    ("64:ff9b::7f00:1", "reserved"),  # NAT64 carrying 127.0.0.1
])
def test_classify_refuses_non_public_addresses(address: str, reason: str) -> None:
    assert reason in (classify(ipaddress.ip_address(address)) or "")


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "1.1.1.1"])
def test_classify_passes_public_addresses(address: str) -> None:
    assert classify(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.2/", "127.0.0.2 is a loopback address"),
    ("http://[::1]/", "::1 is a loopback address"),
    ("http://2130706433/", "127.0.0.1 is a loopback address"),
    ("http://0x7f000001/", "127.0.0.1 is a loopback address"),
    ("http://127.1:8080/", "127.0.0.1 is a loopback address"),
    ("http://[::ffff:127.0.0.1]/", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("http://10.0.0.1/", "private"),
    ("http://0.0.0.0:8000/", "unspecified"),
    ("file:///etc/passwd", "only http and https URLs may be fetched, not file"),
    ("ftp://example.com/x", "only http and https URLs may be fetched, not ftp"),
    ("gopher://example.com/", "not gopher"),
    ("javascript:alert(1)", "not javascript"),
    ("http:///nohost", "names no host"),
    ("http://%31%32%37.0.0.1/", "escaped characters"),
    ("http://[fe80::1%25eth0]/", "zone ids"),
    ("not a url", "only http and https"),
])
async def test_vet_url_refusals(url: str, message: str) -> None:
    guard = SSRFGuard(resolver=resolver_for({}))
    with pytest.raises(BlockedURL, match=message.replace("(", r"\(").replace(")", r"\)")):
        await guard.vet_url(url)


async def test_real_resolution_of_localhost_is_refused() -> None:
    with pytest.raises(BlockedURL, match=r"refused http://localhost:9/: localhost resolves to .*loopback"):
        await SSRFGuard().vet_url("http://localhost:9/")


async def test_any_bad_address_among_several_refuses() -> None:
    guard = SSRFGuard(resolver=resolver_for({"mixed.test": ["93.184.216.34", "10.0.0.5"]}))
    with pytest.raises(BlockedURL, match="mixed.test resolves to 10.0.0.5, a private address"):
        await guard.vet_url("https://mixed.test/")


async def test_public_hosts_pass_with_their_addresses() -> None:
    guard = SSRFGuard(resolver=resolver_for({"example.test": ["93.184.216.34", "93.184.216.34", "2606:2800::1"]}))
    url, addresses = await guard.vet_url("https://Example.TEST./path")
    assert url.host == "example.test."
    assert [str(a) for a in addresses] == ["93.184.216.34", "2606:2800::1"]


async def test_unresolvable_host_is_a_clear_error() -> None:
    guard = SSRFGuard(resolver=resolver_for({}))
    with pytest.raises(ToolError, match="cannot reach http://nowhere.test/: host nowhere.test did not resolve") as info:
        await guard.vet_url("http://nowhere.test/")
    assert not isinstance(info.value, BlockedURL)  # a failure, not a refusal


async def test_allow_hosts_and_networks() -> None:
    table = {"intranet.corp": ["10.0.0.7"], "api.intranet.corp": ["10.0.0.8"], "other.corp": ["10.9.9.9"],
             "meta.corp": ["169.254.169.254"]}
    guard = SSRFGuard(allow_hosts=["intranet.corp", "*.intranet.corp", "meta.corp", "127.0.0.1", "127.0.0.1:8000"],
                      allow_networks=["10.9.0.0/16", "fd12::/16"], resolver=resolver_for(table))
    for url in ("http://intranet.corp/", "http://api.intranet.corp/", "http://other.corp/", "http://[fd12::1]/",
                "http://127.0.0.1:8000/", "http://2130706433/"):
        await guard.vet_url(url)
    # An allowed host name never unlocks a metadata endpoint; only an allowed network covering it could.
    with pytest.raises(BlockedURL, match="cloud metadata"):
        await guard.vet_url("http://meta.corp/")
    with pytest.raises(BlockedURL, match="cloud metadata"):
        await guard.vet_url("http://[fd00:ec2::254]/")
    with pytest.raises(BlockedURL, match="loopback"):
        await guard.vet_url("http://127.0.0.2/")
    assert await SSRFGuard(allow_networks=["169.254.169.254/32"]).vet_url("http://169.254.169.254/")


async def test_allow_hosts_entries_name_their_ports() -> None:
    table = {"intranet.corp": ["10.0.0.7"], "a.svc": ["10.0.0.8"]}
    guard = SSRFGuard(allow_hosts=["intranet.corp", "127.0.0.1:9000", "[::1]:8443", "*.svc:8080"],
                      resolver=resolver_for(table))
    for url in ("http://intranet.corp/", "https://intranet.corp/", "http://127.0.0.1:9000/", "https://[::1]:8443/",
                "http://a.svc:8080/"):
        await guard.vet_url(url)
    # A host without a port is ports 80 and 443 only: allow-listing an address never opens its other ports.
    for url in ("http://intranet.corp:8080/", "http://127.0.0.1:9001/", "http://127.0.0.1/", "http://[::1]/",
                "http://a.svc/"):
        with pytest.raises(BlockedURL):
            await guard.vet_url(url)
    for bad in ("intranet.corp:0", "intranet.corp:http", "[::1]8443", ":80", "host:70000"):
        with pytest.raises(ValueError):
            SSRFGuard(allow_hosts=[bad])


async def test_the_gateways_own_address_is_never_reachable() -> None:
    table = {"localhost": ["127.0.0.1", "::1"], "intranet.corp": ["10.0.0.7"]}
    everything = dict(allow_hosts=["localhost:8000", "127.0.0.1:8000"], allow_networks=["127.0.0.0/8", "10.0.0.0/8"],
                      resolver=resolver_for(table))
    guard = SSRFGuard(**everything, own=[("127.0.0.1", 8000)])
    for url in ("http://127.0.0.1:8000/admin/approvals", "http://localhost:8000/", "http://0.0.0.0:8000/",
                "http://2130706433:8000/"):
        with pytest.raises(BlockedURL, match="this gateway's own address"):
            await guard.vet_url(url)
    await guard.vet_url("http://127.0.0.1:8001/")  # other loopback ports stay as the lists say
    listening_everywhere = SSRFGuard(**everything, own=[("0.0.0.0", 8000)])
    with pytest.raises(BlockedURL, match="this gateway's own address"):
        await listening_everywhere.vet_url("http://127.0.0.1:8000/")
    await listening_everywhere.vet_url("http://intranet.corp:8000/")  # another machine's port 8000


def test_the_gateway_gives_its_own_address_to_tools_and_callbacks(tmp_path) -> None:
    from gateway.app import Gateway
    from gateway.config import ConfigError, Settings, load_settings

    settings = Settings.model_validate({
        "store": {"path": str(tmp_path / "h.db")}, "server": {"port": 8123},
        "tools": {"allow_networks": ["127.0.0.0/8"]}, "bot": {"callback_allow_networks": ["127.0.0.0/8"]},
        "backends": [{"name": "u", "kind": "openai", "base_url": "http://127.0.0.1:9/v1", "models": ["m"]}]})
    gateway = Gateway(settings)
    for guard in (gateway.tool_context.guard, gateway.bot.platforms["webhook"].guard):
        with pytest.raises(BlockedURL, match="own address"):
            asyncio.run(guard.vet_url("http://127.0.0.1:8123/admin/adapters"))
    config = tmp_path / "bad.toml"
    config.write_text('[tools]\nallow_hosts = ["intranet.corp:http"]\n')
    with pytest.raises(ConfigError, match="allow_hosts"):
        load_settings(str(config))
