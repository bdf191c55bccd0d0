"""Run a real gateway as a subprocess on loopback (used by the tests, the demo and the benchmarks).

:class:`RunningServer` starts ``python -m shardserver.cli serve`` on a free
port, waits for its ready line and for ``/readyz`` (200, or 503 because only
the engine is unreachable), fails at once if the
process exits early, and on exit stops it with SIGTERM, then waits, then kills.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["RunningServer", "http_json", "our_shm_segments", "mapped_distributions", "our_processes",
           "leftovers_of_started_servers", "RunningHaproxy", "find_haproxy", "free_port", "http_counts", "metric_sum"]

REPO = Path(__file__).resolve().parent.parent


def http_json(url: str, body: Any = None, headers: dict[str, str] | None = None,
              timeout: float = 10.0, method: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request with the standard library: (status, headers, body bytes)."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def our_shm_segments() -> list[str]:
    """Names of shardserver segments currently in /dev/shm."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("shardserver-"))
    except FileNotFoundError:
        return []


def mapped_distributions(pid: int) -> set[str]:
    """The site-packages distributions (the first path part under ``site-packages/``, e.g.
    ``aiohttp``, ``numpy.libs``, ``csimdjson.abi3.so``) whose files process ``pid`` has mapped
    (``/proc/<pid>/maps``): what it imported, compiled parts included.

    Raises:
        OSError: no such process (or not readable).
    """
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[5].split("site-packages/")[1].split("/")[0]
                for line in f if len(line.split()) > 5 and "site-packages/" in line.split()[5]}


def our_processes() -> list[tuple[int, str]]:
    """(pid, title) of every process whose title starts with ``shardserver:``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if cmd.startswith("shardserver:"):
            out.append((int(d), cmd))
    return out


def leftovers_of_started_servers() -> tuple[list[int], list[str]]:
    """(live pids, /dev/shm segment names) left by the servers this process started.

    Scoped to those servers so that concurrent runs on the same machine do not interfere.
    """
    pids = [p for g in RunningServer.started_pgids for p in _group_members(g)]
    segs = [n for n in our_shm_segments() if any(n.startswith(f"shardserver-{g}-") for g in RunningServer.started_pgids)]
    return pids, segs


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


class RunningServer:
    """Context manager running ``shardserver serve`` on 127.0.0.1 and a free port.

    Args:
        config: path of the TOML config (default ``configs/demo.toml``).
        env: extra environment (``SHARDSERVER_<SECTION>__<KEY>`` overrides).
        args: extra ``serve`` flags.
        start_timeout: seconds to wait for readiness.
    """

    # Process groups (= supervisor pids) of every server started from this process.
    started_pgids: list[int] = []

    def __init__(self, config: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None,
                 args: list[str] | None = None, start_timeout: float = 60.0, nofile: int | None = None) -> None:
        self.config = str(config or REPO / "configs" / "demo.toml")
        self.nofile = nofile  # RLIMIT_NOFILE (soft and hard) of the server process, when given
        self.env = env or {}
        self.args = args or []
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.port = 0
        self.log_lines: list[str] = []
        self.leftover_processes = False
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "RunningServer":
        env = {**os.environ, **self.env}
        cmd = [sys.executable, "-m", "shardserver.cli", "serve", "--config", self.config,
               "--host", "127.0.0.1", "--port", "0", *self.args]
        limit = self.nofile

        def lower_nofile() -> None:  # in the child, before exec
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=str(REPO), start_new_session=True,
                                     preexec_fn=lower_nofile if limit is not None else None)
        RunningServer.started_pgids.append(self.proc.pid)
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log_lines.append(line.rstrip("\n"))
                if line.startswith("shardserver ready on "):
                    self.url = line.split()[-1].strip()
                    ready.set()
                if os.environ.get("SHARDSERVER_TEST_ECHO"):
                    sys.stderr.write(line)

        self._reader = threading.Thread(target=pump, name="server-log-pump", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.start_timeout
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                self.__exit__(None, None, None)
                raise RuntimeError(f"server exited unexpectedly (code {code}) or did not start:\n"
                                   + "\n".join(self.log_lines[-40:]))
        self.port = int(self.url.rsplit(":", 1)[1])
        while time.monotonic() < deadline:
            try:
                status, _, body = http_json(self.url + "/readyz", timeout=2)
                if status == 200:
                    return self
                # Every encoder is up and has probed the engine, which is unreachable or serves
                # another model than engine.model: started (tests of engine failures run gateways
                # in front of a dead or wrong engine).
                why = json.loads(body) if status == 503 else {}
                if ((why.get("engine_down") or why.get("engine_model_missing"))
                        and not why.get("encoders_down") and not why.get("engine_unknown")):
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError("server did not become ready:\n" + "\n".join(self.log_lines[-40:]))

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the supervisor, wait up to ``timeout`` s, then kill the whole process group."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        # Anything of the group still alive now is a leak: record it, then kill it.
        time.sleep(0.2)
        if _group_members(self.proc.pid):
            self.leftover_processes = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._reader is not None:
            self._reader.join(2)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        status, _, body = http_json(self.url + "/stats")
        assert status == 200, body
        return json.loads(body)


# -- several hosts behind HAProxy (tests/multihost/, benchmarks/bench_multihost.py) -------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, close)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_haproxy() -> tuple[str | None, str]:
    """(path of an HAProxy >= 2.6 binary or None, why not): looks on PATH and in /usr/sbin."""
    import re
    import shutil

    path = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)
    if path is None:
        return None, "haproxy is not installed (make test installs it: apt-get install haproxy)"
    out = subprocess.run([path, "-v"], capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"version (\d+)\.(\d+)", out)
    if m is None or (int(m.group(1)), int(m.group(2))) < (2, 6):
        return None, f"{path} is not HAProxy >= 2.6: {out.splitlines()[:1]}"
    return path, ""


def metric_sum(source: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` (e.g. ``shardserver_http_requests_total``) whose
    labels include ``labels``; 0.0 when none does.

    ``source``: a Prometheus text exposition, or a gateway's base URL (``http://...``: its
    ``GET /metrics`` is read and must answer 200). Parsed with ``prometheus_client.parser``.
    """
    if source.startswith(("http://", "https://")):
        status, _, body = http_json(source.rstrip("/") + "/metrics")
        assert status == 200, body[:200]
        source = body.decode()
    from prometheus_client.parser import text_string_to_metric_families

    return sum(smp.value for fam in text_string_to_metric_families(source) for smp in fam.samples
               if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()))


def http_counts(url: str) -> dict[tuple[str, str], float]:
    """``shardserver_http_requests_total`` of one gateway host: {(endpoint, code): count}."""
    import re

    status, _, body = http_json(url + "/metrics")
    assert status == 200, body[:200]
    out: dict[tuple[str, str], float] = {}
    for m in re.finditer(r'^shardserver_http_requests_total\{([^}]*)\} (\S+)$', body.decode(), re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        key = (labels.get("endpoint", ""), labels.get("code", ""))
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


class RunningHaproxy:
    """Context manager running HAProxy in the foreground (``-db``) in front of gateway hosts.

    The config comes from :func:`shardserver.haproxy.render_haproxy_config` (what
    ``shardserver haproxy-config`` prints), written to ``workdir/haproxy.cfg``; HAProxy listens
    on a free 127.0.0.1 port (``url``), its stats page on another (``stats_url``).

    Args:
        hosts: (host_id, "127.0.0.1:port") of every gateway host.
        workdir: where the config and HAProxy's output go.
        haproxy: the binary (:func:`find_haproxy`).
        check_interval_ms, fall, rise: health-check settings passed to the generator.
        start_timeout: seconds to wait for the stats page and for every server to be UP.
    """

    def __init__(self, hosts: list[tuple[str, str]], workdir: str | os.PathLike[str], haproxy: str = "haproxy",
                 check_interval_ms: int = 2000, fall: int = 2, rise: int = 2, start_timeout: float = 20.0,
                 wait_all_up: bool = True) -> None:
        self.hosts = hosts
        self.workdir = Path(workdir)
        self.haproxy = haproxy
        self.check = (check_interval_ms, fall, rise)
        self.start_timeout = start_timeout
        self.wait_all_up = wait_all_up
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = self.stats_port = 0
        self.url = self.stats_url = ""
        self.config_path = self.workdir / "haproxy.cfg"
        self.log_path = self.workdir / "haproxy.log"

    def __enter__(self) -> "RunningHaproxy":
        from .haproxy import GatewayHost, render_haproxy_config

        self.port, self.stats_port = free_port(), free_port()
        self.url, self.stats_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.stats_port}"
        inter, fall, rise = self.check
        self.config_path.write_text(render_haproxy_config(
            [GatewayHost(h, a) for h, a in self.hosts], bind=f"127.0.0.1:{self.port}",
            stats_bind=f"127.0.0.1:{self.stats_port}", check_interval_ms=inter, fall=fall, rise=rise, maxconn=4096))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([self.haproxy, "-db", "-f", str(self.config_path)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"haproxy exited with {self.proc.returncode}:\n{self.log()}")
            try:
                states = self.server_states()
                if not self.wait_all_up or all(st == "UP" for st in states.values()):
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"haproxy did not start or its servers are not UP:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stats(self) -> list[dict[str, str]]:
        """HAProxy's stats CSV (``/stats;csv``): one dict per proxy/server row (``pxname``, ``svname``,
        ``status``, ``stot`` sessions, ``hrsp_2xx``..., ``check_status``, ...)."""
        import csv

        with urllib.request.urlopen(self.stats_url + "/stats;csv", timeout=5) as resp:
            text = resp.read().decode()
        rows = list(csv.reader(text.lstrip("# ").splitlines()))
        return [dict(zip(rows[0], r)) for r in rows[1:] if r]

    def server_states(self, backend: str | None = None) -> dict[str, str]:
        """{host_id: "UP" | "DOWN" | ...} of one backend's servers (``gateways``: asample and the
        rest, checked with /readyz; ``owners``: retrieve_future, checked with /healthz), or of
        both as {"gateways/h1": ...} when ``backend`` is None."""
        out = {}
        for r in self.stats():
            if r["pxname"] in ("gateways", "owners") and r["svname"] not in ("FRONTEND", "BACKEND"):
                if backend is None:
                    out[f"{r['pxname']}/{r['svname']}"] = r["status"].split(" ")[0]
                elif r["pxname"] == backend:
                    out[r["svname"]] = r["status"].split(" ")[0]
        return out

    def wait_state(self, host_id: str, state: str, timeout: float, backend: str = "gateways") -> float:
        """Wait until ``host_id`` has ``state`` in ``backend``; returns the seconds waited.

        Raises:
            TimeoutError: not reached within ``timeout`` seconds.
        """
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.server_states(backend).get(host_id) == state:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise TimeoutError(f"haproxy {backend}/{host_id} not {state} after {timeout} s: {self.server_states()}")

    def cpu_seconds(self) -> float:
        """utime + stime of the HAProxy process so far (s)."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM (HAProxy's hard stop), wait, then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def __exit__(self, *exc: Any) -> None:
        self.stop()
