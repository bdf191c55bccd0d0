"""HAProxy configuration for several gateway hosts: ``shardserver haproxy-config``.

Several shardserver hosts serve one Tinker endpoint behind HAProxy (>= 2.6, the Debian 12
package). Routing is configuration, not code of ours:

* ``retrieve_future`` goes to backend ``owners``: HAProxy waits for the (small) request body
  (``http-request wait-for-body``), takes ``request_id`` out of the JSON (``json_query``), and
  its second ``-``-separated field, the issuing host's ``server.host_id`` (the future-ID format
  is in :mod:`shardserver.ids`), names the server: ``use-server %[var(txn.owner)]``. HAProxy
  server names therefore *are* the host ids. This backend checks ``GET /healthz`` (process
  up): an owner that is alive but not ready (its engine unreachable) still serves its
  finished results.
* ``cancel_future`` (same ``request_id`` body) goes to the owner the same way, so a cancelled
  sample's engine request is stopped on the host that runs it.
* ``client/config`` is answered by HAProxy itself, ``{"pjwt_auth_enabled": false}`` without
  ``sample_use_retrieve_futures``: the session-wide poller (``retrieve_futures``) asks one host
  for all of a session's futures, but ``asample`` spreads them over the hosts, so behind the
  balancer the SDK keeps polling each future at its owner.
* Everything else (``asample``, sessions, ...) goes to backend ``gateways``: the host that
  answers ``GET /readyz`` with 200 (encoders up, engine reachable) and has the fewest
  connections (``balance leastconn``). The host that accepts an ``asample`` owns its future.
* When the owner is down, ``use-server`` does not apply and the poll goes to a live host, which
  answers 410 (another host's future); the SDK then resubmits the sample, which a ready host
  serves. A request that meets a dead host before its health check has noticed is re-sent to
  another host by HAProxy (``retry-on conn-failure empty-response``, ``option redispatch 1``),
  and ten such errors mark the host down at once (``observe layer4``).
* When no host is alive at all, HAProxy itself answers polls with 410 (every future is gone:
  a host that comes back starts a new run), so the SDK resubmits and backs off on ``asample``
  instead of re-polling at once on 503s.
* Both checks also require ``X-Shardserver-Host`` equal to the server's name, so a host started
  with the wrong ``server.host_id`` receives no traffic.
* HAProxy's stats page (HTML, ``;csv`` for scripts) and its Prometheus exporter
  (``/metrics``) listen on a separate, loopback-only address.

Adding a host is one ``--host`` flag (its ``server`` line in both backends). Nothing on the
data path is ours: gateways never forward to each other and have no membership protocol.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .ids import HOST_ID_RE

__all__ = ["GatewayHost", "parse_host", "parse_address", "render_haproxy_config", "HAPROXY_MIN_VERSION"]

HAPROXY_MIN_VERSION = (2, 6)

_ADDR_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


def parse_address(spec: str, what: str = "address") -> str:
    """Validate ``host:port`` (``[v6]:port`` for IPv6) and return it unchanged.

    Raises:
        ValueError: not ``host:port``, or the port is outside 1..65535.
    """
    m = _ADDR_RE.match(spec)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(f"{what} must be HOST:PORT with a port in 1..65535, got {spec!r}")
    return spec


@dataclass(frozen=True, slots=True)
class GatewayHost:
    """One gateway host: its ``server.host_id`` (the HAProxy server name) and ``host:port``."""

    host_id: str
    address: str


def parse_host(spec: str) -> GatewayHost:
    """``"h1=10.0.0.1:8000"`` -> :class:`GatewayHost`.

    Raises:
        ValueError: no ``=``, a host id that is not 1-16 of ``[a-z0-9]`` (``server.host_id``'s
            rule), or an invalid address.
    """
    host_id, sep, addr = spec.partition("=")
    if not sep:
        raise ValueError(f"--host must be HOST_ID=HOST:PORT (e.g. h1=10.0.0.1:8000), got {spec!r}")
    if not HOST_ID_RE.fullmatch(host_id):
        raise ValueError(f"host id {host_id!r} must be 1-16 characters of [a-z0-9] (as server.host_id)")
    return GatewayHost(host_id, parse_address(addr, f"address of host {host_id}"))


def render_haproxy_config(hosts: list[GatewayHost], *, bind: str = "0.0.0.0:8080",
                          stats_bind: str = "127.0.0.1:8404", check_interval_ms: int = 2000,
                          fall: int = 2, rise: int = 2, maxconn: int = 20000,
                          timeout_server_s: int = 60, check_timeout_s: int = 5) -> str:
    """The text of an ``haproxy.cfg`` that spreads the Tinker API over ``hosts``.

    Args:
        hosts: the gateway hosts, at least one, host ids unique.
        bind: where HAProxy listens for SDK clients (``host:port``).
        stats_bind: where the stats page (``/stats``) and Prometheus exporter (``/metrics``)
            listen; keep it on loopback or a management network.
        check_interval_ms: milliseconds between health checks of each host (``inter``). A dead
            host is marked down after ``fall`` failed checks, a returning one up after ``rise``.
        maxconn: HAProxy's global connection limit (client plus server side share the fds).
        timeout_server_s: seconds a gateway may take to answer; must exceed
            ``futures.long_poll_s`` (25 s by default), the hold of one ``retrieve_future``.
        check_timeout_s: seconds a health check may wait for ``/readyz``'s answer once connected
            (a refused connection fails at once).

    Raises:
        ValueError: no hosts, a duplicate host id, an invalid address or number.
    """
    if not hosts:
        raise ValueError("at least one --host is needed")
    seen: set[str] = set()
    for h in hosts:
        if h.host_id in seen:
            raise ValueError(f"host id {h.host_id!r} given twice")
        seen.add(h.host_id)
    parse_address(bind, "--bind")
    parse_address(stats_bind, "--stats-bind")
    for name, v, lo in (("--check-interval-ms", check_interval_ms, 100), ("--fall", fall, 1), ("--rise", rise, 1),
                        ("--maxconn", maxconn, 64), ("--timeout-server-s", timeout_server_s, 30),
                        ("--check-timeout-s", check_timeout_s, 1)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    servers = "\n".join(f"    server {h.host_id} {h.address}" for h in hosts)
    flags = " ".join(f"--host {h.host_id}={h.address}" for h in hosts)
    common = f"""\
    balance leastconn
    # A request that met a dead host before its health check failed is re-sent to another one.
    retries 2
    option redispatch 1
    retry-on conn-failure empty-response
    # A busy host may take a while to answer its check: wait {check_timeout_s} s before calling it failed.
    timeout check {check_timeout_s}s
    option httpchk"""
    check = (f"    http-check expect status 200\n"
             f"    # The answer must come from the host this server names (X-Shardserver-Host = server.host_id).\n"
             f'    http-check expect hdr name x-shardserver-host value-lf "%[srv_name]"\n'
             f"    default-server check inter {check_interval_ms}ms fall {fall} rise {rise} "
             f"observe layer4 error-limit 10 on-error mark-down")
    return f"""\
# HAProxy >= 2.6 in front of {len(hosts)} shardserver gateway host(s) (docs/MULTI_HOST.md). Generated by
#   shardserver haproxy-config {flags}
# Server names are the hosts' server.host_id; every host has the same server.id_secret.
# Add a host: its `server` line in both backends (or one more --host). Remove one: delete both.

global
    maxconn {maxconn}

defaults
    mode http
    option http-keep-alive
    # Connections a client closes before sending a request are not counted as errors.
    option http-ignore-probes
    timeout connect 5s
    timeout client 120s
    timeout http-request 30s
    timeout http-keep-alive 75s
    # Longer than futures.long_poll_s: a held retrieve_future answers 408 try_again in time.
    timeout server {timeout_server_s}s
    timeout queue 30s

frontend tinker
    bind {bind}
    # The session-wide poller needs every future of a session on one host; asample spreads them over
    # the hosts. So the balancer answers client/config itself, without sample_use_retrieve_futures.
    http-request return status 200 content-type application/json string '{{"pjwt_auth_enabled":false}}' if {{ path /api/v1/client/config }}
    use_backend owners if {{ path /api/v1/retrieve_future /api/v1/cancel_future }}
    default_backend gateways

# asample and everything else: the ready host (GET /readyz: encoders up, engine reachable)
# with the fewest connections. The host that accepts an asample owns its future.
backend gateways
{common}
    http-check send meth GET uri /readyz
{check}
{servers}

# retrieve_future and cancel_future: the future's owner, named by the second field of request_id
# (f<run>-<host_id>-<random>-<mac>), while its process is up (GET /healthz), ready or not: it may
# hold finished results while its engine is unreachable. Owner down: the live host with the
# fewest connections answers 410 (another host's future) and the SDK resubmits the sample.
backend owners
{common}
    http-check send meth GET uri /healthz
{check}
    # No host alive: every future is gone (a host that comes back starts a new run). 410 makes the
    # SDK resubmit the sample, and its asample retries back off until a host is ready.
    http-request return status 410 content-type application/json string '{{"error":"no gateway host is up; resubmit"}}' if {{ nbsrv lt 1 }}
    http-request wait-for-body time 2s
    http-request set-var(txn.owner) req.body,json_query('$.request_id'),field(2,-)
    use-server %[var(txn.owner)] if {{ var(txn.owner) -m found }}
{servers}

listen stats
    # HAProxy's own view of the balance: per-host sessions, requests, status, check results.
    bind {stats_bind}
    http-request use-service prometheus-exporter if {{ path /metrics }}
    stats enable
    stats uri /stats
    stats refresh 5s
    stats show-legends
"""
