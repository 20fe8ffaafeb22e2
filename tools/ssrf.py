"""The SSRF guard: which URLs and addresses the network tools may reach.

Only http(s) URLs pass. A host is resolved once; when ANY of its addresses is not public (loopback,
private, link-local, multicast, unspecified, reserved, shared, or a cloud metadata endpoint) the URL is
refused, unless the operator allow-listed the host name (``[tools] allow_hosts``: ``host`` for ports 80 and 443
only, ``host:port`` for that port) or the address's network (``[tools] allow_networks``). Metadata endpoints are
refused even for an allow-listed host name; only an ``allow_networks`` entry that covers them lets them through.
The gateway's own listening address (``own``) is refused whatever the lists say: a tool must never reach the
gateway's routes, admin routes included, from inside.

The guard hands back the addresses it vetted, and the callers (``tools.net``) connect to exactly those,
so a DNS answer that changes between the check and the connection (rebinding) cannot slip through.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Iterable

import httpx
import structlog

from tools.spec import ToolError

log = structlog.get_logger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]

# Instance-metadata services: credentials live behind these, so they get a name of their own in refusals.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean
    "169.254.170.2",  # AWS ECS task metadata
    "fd00:ec2::254",  # AWS over IPv6
    "100.100.100.200",  # Alibaba Cloud
    "192.0.0.192",  # Oracle Cloud
))
_METADATA_REASON = "a cloud metadata address"
SCHEMES = frozenset({"http", "https"})
# What the C library's inet_aton would read as an IPv4 address: "2130706433", "0x7f000001", "0177.1", "127.1".
_NUMERIC_HOST = re.compile(r"^[0-9][0-9a-fx.]*$", re.IGNORECASE)
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_](?:[a-z0-9_-]{0,62})(?:\.[a-z0-9_](?:[a-z0-9_-]{0,62}))*$")


class BlockedURL(ToolError):
    """The guard refused a URL or an address: ``refused <target>: <reason>``."""

    def __init__(self, target: str, reason: str) -> None:
        super().__init__(f"refused {target}: {reason}")
        self.target = target
        self.reason = reason

    def retarget(self, target: str) -> BlockedURL:
        """The same refusal, naming ``target`` (the URL a request was for, rather than its host)."""
        return BlockedURL(target, self.reason)


def parse_ip(host: str) -> IPAddress | None:
    """The address a literal host names, read the way the resolver would (integer, hex, octal forms too)."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _NUMERIC_HOST.match(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def _embedded_ipv4(ip: IPAddress) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries (mapped, 6to4, Teredo); each must pass the guard as well."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return []
    found: list[ipaddress.IPv4Address] = []
    if ip.ipv4_mapped is not None:
        found.append(ip.ipv4_mapped)
    if ip.sixtofour is not None:
        found.append(ip.sixtofour)
    if ip.teredo is not None:
        found.extend(ip.teredo)
    return found


def classify(ip: IPAddress) -> str | None:
    """Why an address is off limits ("a loopback address", ...), or None for a public one."""
    for inner in _embedded_ipv4(ip):
        reason = classify(inner)
        if reason:
            return f"{reason} (inside {ip})"
    if ip in METADATA_ADDRESSES:
        return _METADATA_REASON
    checks = (
        (ip.is_loopback, "a loopback address"),
        (ip.is_unspecified, "an unspecified address"),
        (ip.is_link_local, "a link-local address"),
        (ip.is_multicast, "a multicast address"),
        (ip.is_reserved, "a reserved address"),
        (ip.is_private, "a private address"),
        (not ip.is_global, "a non-public address"),
    )
    return next((reason for hit, reason in checks if hit), None)


def normalize_host(host: str) -> str:
    """Lower case, no brackets, no trailing dot: the form allow-lists are matched against."""
    host = host.strip().strip("[]").lower().rstrip(".")
    ip = parse_ip(host)
    return str(ip) if ip is not None else host


DEFAULT_PORTS = frozenset({80, 443})


def parse_allow_host(entry: str) -> tuple[str, frozenset[int]]:
    """An ``allow_hosts`` entry as (host or ``*.domain`` pattern, ports): ``host`` means ports 80 and 443,
    ``host:port`` (``[v6]:port`` for an IPv6 address) that port only. ``ValueError`` for a malformed entry."""
    entry = entry.strip().lower()
    host, port = entry, None
    if entry.startswith("["):
        inside, _, rest = entry[1:].partition("]")
        host = inside
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{entry!r}: expected [address] or [address]:port")
            port = rest[1:]
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    if not host:
        raise ValueError(f"{entry!r} names no host")
    if port is None:
        return host, DEFAULT_PORTS
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r}: the port must be a number from 1 to 65535")
    return host, frozenset({int(port)})


async def _system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@functools.cache
def _local_addresses() -> frozenset[IPAddress]:
    """This machine's own addresses, as its host name resolves (best effort: none when it does not)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return frozenset()
    return frozenset(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos)


class SSRFGuard:
    """Vets URLs and resolves hosts to the addresses a network tool may connect to."""

    def __init__(
        self,
        allow_hosts: Iterable[str] = (),
        allow_networks: Iterable[str] = (),
        resolver: Resolver | None = None,
        *,
        own: Iterable[tuple[str, int]] = (),
    ) -> None:
        self._exact: dict[str, frozenset[int]] = {}
        self._suffixes: list[tuple[str, frozenset[int]]] = []
        for entry in allow_hosts:
            if not entry.strip():
                continue
            host, ports = parse_allow_host(entry)
            if host.startswith("*."):
                self._suffixes.append((host[1:], ports))
            else:
                host = normalize_host(host)
                self._exact[host] = self._exact.get(host, frozenset()) | ports
        self._networks = [ipaddress.ip_network(n, strict=False) for n in allow_networks]
        self._resolve = resolver or _system_resolver
        self._own = [(parse_ip(host), port) for host, port in own]

    def host_allowed(self, host: str, port: int) -> bool:
        """Whether the operator allow-listed this host name on this port (exactly, or by a ``*.domain`` entry)."""
        host = normalize_host(host)
        if port in self._exact.get(host, ()):
            return True
        return any(host.endswith(suffix) and port in ports for suffix, ports in self._suffixes)

    def _is_own(self, ip: IPAddress, port: int) -> bool:
        """Whether ``ip:port`` is where this gateway listens (any local address, when it listens on all)."""
        for own_ip, own_port in self._own:
            if port != own_port:
                continue
            if own_ip is None or own_ip.is_unspecified:
                if ip.is_loopback or ip.is_unspecified or ip in _local_addresses():
                    return True
            elif ip == own_ip or (ip.is_loopback and own_ip.is_loopback) or ip.is_unspecified:
                return True
        return False

    def _network_allowed(self, ip: IPAddress) -> bool:
        return any(ip.version == net.version and ip in net for net in self._networks)

    def check_url(self, url: str | httpx.URL) -> httpx.URL:
        """The parsed URL when its scheme and host are acceptable; no resolution yet."""
        try:
            parsed = url if isinstance(url, httpx.URL) else httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as exc:
            raise BlockedURL(str(url), f"not a valid URL ({exc})") from None
        if parsed.scheme not in SCHEMES:
            other = f", not {parsed.scheme}" if parsed.scheme else ""
            raise BlockedURL(str(url), f"only http and https URLs may be fetched{other}")
        if not parsed.host:
            raise BlockedURL(str(url), "the URL names no host")
        self._check_host_syntax(parsed.host, str(url))
        return parsed

    @staticmethod
    def _check_host_syntax(host: str, shown: str) -> None:
        bare = host.strip("[]").lower().rstrip(".")
        if "%" in bare:
            raise BlockedURL(shown, "escaped characters or zone ids are not allowed in the host")
        if parse_ip(bare) is None and not _HOSTNAME.match(bare):
            raise BlockedURL(shown, f"{host!r} is not a valid host name")

    async def resolve(self, host: str, port: int, *, shown: str | None = None) -> list[IPAddress]:
        """The addresses to connect to for ``host``; refuses when any of them is off limits.

        ``shown`` is what refusals name (the URL, when there is one).
        """
        shown = shown or host
        self._check_host_syntax(host, shown)
        literal = parse_ip(host)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                raw = await self._resolve(host.strip("[]").rstrip("."), port)
            except OSError as exc:
                raise ToolError(f"cannot reach {shown}: host {host} did not resolve ({exc})") from None
            addresses = list(dict.fromkeys(ipaddress.ip_address(a.split("%", 1)[0]) for a in raw))
            if not addresses:
                raise ToolError(f"cannot reach {shown}: host {host} has no addresses")
        allowed_host = self.host_allowed(host, port)
        for ip in addresses:
            if self._is_own(ip, port):
                log.warning("ssrf.refused", target=shown, address=str(ip), reason="the gateway itself")
                raise BlockedURL(shown, f"{ip}:{port} is this gateway's own address")
            reason = classify(ip)
            if reason is None or self._network_allowed(ip):
                continue
            if allowed_host and not reason.startswith(_METADATA_REASON):
                continue
            why = f"{host} resolves to {ip}, {reason}" if literal is None else f"{ip} is {reason}"
            log.warning("ssrf.refused", target=shown, address=str(ip), reason=reason)
            raise BlockedURL(shown, why)
        return addresses

    async def vet_url(self, url: str | httpx.URL) -> tuple[httpx.URL, list[IPAddress]]:
        """Checks a URL and resolves its host: what a tool does before it sends anything."""
        parsed = self.check_url(url)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        return parsed, await self.resolve(parsed.host, port, shown=str(url))
