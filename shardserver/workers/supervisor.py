"""The supervisor: owns every child process and every ``/dev/shm`` name of a run.

``Supervisor(cfg).run()`` is ``shardserver serve``:

0. read the API keys (``auth``), failing with a ConfigError if ``mode = "keys"`` finds none;
   read (or create once) the ID signing secret (:func:`shardserver.ids.load_id_secret`), so
   that sessions survive restarts;
1. raise the soft RLIMIT_NOFILE to the hard limit (:func:`raise_nofile_limit`; logged);
   remove segments and run directories left by dead runs; check that the arenas fit in the
   free space of ``/dev/shm`` (a ConfigError naming ``shards.arena_bytes`` otherwise);
   create this run's directory and its ``metrics/`` folder (``PROMETHEUS_MULTIPROC_DIR`` of
   every child, see :mod:`shardserver.metrics`);
2. bind the one listening socket (``server.backlog``, with a warning when it is above
   ``net.core.somaxconn``, which caps it; an address in use is retried for ``BIND_RETRY_S``);
3. start the engine simulator when ``engine.url`` is empty;
4. create one arena per shard and start S encoders; wait for each READY
   (``shards.ready_timeout_s``), failing fast with the exit code of a child
   that died during start;
5. start F front-ends on the shared socket;
   Every child asks the kernel for a signal when the supervisor dies (``PR_SET_PDEATHSIG``,
   see :func:`shardserver.process.die_with_parent`): SIGTERM for encoders (they unlink their arenas)
   and front-ends (they close the listening socket first), SIGKILL for the simulator; so a
   SIGKILLed supervisor leaves no child and frees its port at once;
6. watch the children's sentinels: a dead encoder gets a fresh arena and is
   restarted (its futures are lost and answer 410); a dead front-end is
   restarted; and their heartbeats (:mod:`.liveness`): an encoder or front-end that has not
   beaten for ``server.liveness_timeout_s`` (stopped, or its event loop blocked) is SIGKILLed
   (logged, ``shardserver_worker_hung_kills_total{role}``) and restarted like a dead one;
7. on SIGTERM/SIGINT: close the supervisor's copy of the listening socket (the kernel stops
   listening when the front-ends have closed theirs, which they do first thing, see
   :class:`.frontend.DrainingServer`); stop the front-ends (graceful, bounded by
   ``server.graceful_shutdown_s``), then the encoders and the simulator,
   kill what is left, unlink every segment, remove the run directory.

Signal handlers only record the signal; the main loop does the work.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from ..api.auth import load_key_table
from ..config import Config, mask_url
from ..ids import load_id_secret, restore_secret_file
from ..prometheus_dir import mark_process_dead, prepare_prometheus_dir
from .liveness import Heartbeats
from ..shm.arena import (SHM_DIR, check_shm_space, create_segment, pid_alive, remove_stale_segments, segment_name,
                         shm_free_bytes, unlink_segment)
from .journal import JOURNAL_DIR, journal_tag
from ._subprocess import run_encoder, run_front_end

__all__ = ["Supervisor", "ChildSpec", "StartupError"]

log = logging.getLogger("shardserver.supervisor")
_CTX = mp.get_context("spawn")
RUN_DIR_PREFIX = "shardserver-run-"
# A child that dies within this many seconds of its start counts as crash-looping: its next
# restarts wait 0.5, 1, 2 ... 30 s.
CRASH_LOOP_WINDOW_S = 10.0
# An address in use is retried this long at start (children of a crashed run closing it).
BIND_RETRY_S = 1.0
# The supervisor's loop waits 0.2 s at a time for a child to exit: a wait that returns more than
# this many seconds late means the supervisor itself was not running (the whole process group or
# host was paused: SIGSTOP/SIGCONT, `docker pause`, a VM stun). Its children were stopped too, so
# their heartbeats are judged from the resume on, not from before the pause. (Work the loop does
# between waits, such as restarting a child, is not taken for a pause.)
SUPERVISOR_STALL_S = 2.0
#: Seconds between the supervisor's looks at the run directory (recreated if a /tmp cleaner
#: removed it; the encoders look at their control sockets as often).
RUN_DIR_CHECK_S = 5.0
#: Seconds between touches of the run directory and its files (a cleaner by age never finds them old).
RUN_DIR_TOUCH_S = 3600.0
_SUPERVISE_WAIT_S = 0.2


class StartupError(RuntimeError):
    """A child failed to start (it exited, or did not report READY in time)."""


class _StopDuringStart(Exception):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) arrived before every child was READY: the start is
    abandoned, and the gateway never says it is ready (a wrapper waiting for that line would
    take a stopping gateway for a serving one)."""


@dataclass
class ChildSpec:
    role: str           # "encoder", "front-end", "engine-sim"
    index: int
    proc: Any = None
    incarnation: int = 0
    restarts: int = 0
    started_at: float = 0.0      # time.monotonic() of the last start
    fast_failures: int = 0       # consecutive deaths within CRASH_LOOP_WINDOW_S of a start
    restart_at: float = 0.0      # when a held-back restart is due (0: none)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}" if self.role != "engine-sim" else self.role


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def _journal_dir_problem(state_dir: str) -> str:
    """Why ``<state_dir>/futures`` (the encoders' journals, :mod:`shardserver.workers.journal`)
    cannot be used, or ``""`` when it can: it is made (mode 0700) if missing and must be a
    writable directory."""
    if not state_dir:
        return "server.state_dir is empty and there is no $XDG_STATE_HOME or $HOME to put it under"
    path = os.path.join(state_dir, JOURNAL_DIR)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    return ""


def raise_nofile_limit() -> tuple[int, int, int, str]:
    """Raise this process's soft ``RLIMIT_NOFILE`` (open file descriptors: one per client
    connection in a front-end) to its hard limit; the children started afterwards inherit it.
    A hard limit of ``RLIM_INFINITY`` is taken as ``/proc/sys/fs/nr_open``, the most the kernel
    allows.

    Returns:
        (soft limit before, soft limit now, hard limit, error text or ``""``); never raises.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft >= target:
        return soft, soft, hard, ""
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        return soft, soft, hard, str(exc)
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard, ""


def somaxconn() -> int | None:
    """``net.core.somaxconn`` of this network namespace: the kernel silently caps every
    ``listen()`` backlog at it. None if it cannot be read."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _remove_stale_run_dirs() -> None:
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        if not name.startswith(RUN_DIR_PREFIX):
            continue
        try:
            pid = int(name[len(RUN_DIR_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def shutdown_procs(procs: list[Any], timeout: float) -> None:
    """Terminate every process, join against one shared deadline, then kill survivors.

    A module-level function (not a method) so it can serve as a finalizer.
    """
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            log.warning("[shutdown] pid %s did not stop in %.1f s: killing", p.pid, timeout)
            p.kill()
            p.join(2)


def _run_engine_sim(sim_cfg: dict[str, Any], **kwargs: Any) -> None:
    """Spawn target of the embedded simulator: :func:`shardserver.engine_sim.run_process`,
    imported in the child only (numpy and aiohttp cost the supervisor ~0.3 s otherwise)."""
    from ..process import die_with_parent

    # SIGKILL: nothing to clean up, and its aiohttp shutdown would wait for requests in flight.
    die_with_parent(kwargs["parent_pid"], signal.SIGKILL)
    from ..engine_sim import run_process

    run_process(sim_cfg, **kwargs)


class Supervisor:
    """Runs one gateway instance. ``run()`` blocks until SIGTERM, SIGINT or SIGHUP (the same clean shutdown), or :meth:`request_stop`.

    Args:
        cfg: the validated configuration.
        on_ready: called with the bound (host, port) once every child is READY.
    """

    def __init__(self, cfg: Config, on_ready: Callable[[str, int], None] | None = None) -> None:
        self.cfg = cfg
        self.on_ready = on_ready
        self.pid = os.getpid()
        self._judge_from = 0.0  # heartbeats older than this (a pause of the supervisor) count from it
        self.run_id = os.urandom(4).hex()
        # The ID signing secret, kept across restarts (ConfigError naming server.state_dir if
        # server.require_persistent_secret is set and it cannot be read or created).
        self.id_secret = load_id_secret(cfg.server.id_secret, cfg.server.state_dir,
                                        cfg.server.require_persistent_secret)
        self.secret = self.id_secret.secret
        # API keys, read once here (ConfigError naming auth.keys_file if mode="keys" finds none);
        # front-ends receive only salted digests.
        self.keys = load_key_table(cfg.auth)
        if cfg.auth.mode == "keys" and not cfg.auth.key_share:
            # An equal share per key of every shard's arena and pending bounds (auth.key_share = 0).
            share = 1.0 / max(1, len(self.keys))
            self.cfg = cfg = dataclasses.replace(cfg, auth=dataclasses.replace(cfg.auth, key_share=share))
        if cfg.auth.mode == "keys":
            log.info("auth: each API key may hold %.3g of every shard's arena, pending futures and pending request "
                     "bytes (auth.key_share)", cfg.auth.key_share)
        if cfg.futures.retrieve_futures:
            problem = _journal_dir_problem(cfg.server.state_dir)
            if problem:
                # A poller-mode SDK learns of a future only from the server: without journals the
                # futures in flight at a restart would never be reported and their samples would
                # wait forever. Per-request polling gets 410 for them and resubmits.
                log.warning("the session-wide poller is not announced this run (futures.retrieve_futures): the "
                            "futures journals cannot be kept (%s); new SDKs poll each sample with retrieve_future. "
                            "Set server.state_dir to a writable directory", problem)
                self.cfg = cfg = dataclasses.replace(
                    cfg, futures=dataclasses.replace(cfg.futures, retrieve_futures=False))
        self.run_dir = ""
        self._run_dir_checked = 0.0  # monotonic time of the last look at the run directory
        self._secret_error_logged = False  # the ERROR about an unwritable secret file was logged
        self._run_dir_touched = time.monotonic()
        self.sock: socket.socket | None = None
        self.sim_sock: socket.socket | None = None
        self.engine_url = cfg.engine.url
        self.encoders: list[ChildSpec] = []
        self.front_ends: list[ChildSpec] = []
        self.sim: ChildSpec | None = None
        # One heartbeat slot per encoder (slot s) and front-end (slot S + i); made in run().
        self.heartbeats: Heartbeats | None = None
        self.segments: set[str] = set()
        self._signals: list[int] = []
        self._stopping = False
        self.address: tuple[str, int] | None = None
        self.journal_tag = ""  # names the encoders' journals (workers/journal.py): the listening address

    def _log_id_secret(self) -> None:
        sec = self.id_secret
        for w in sec.warnings:
            log.warning("%s", w)
        if sec.persistent:
            how = "created now" if sec.created else "read"
            where = sec.source if sec.source == "server.id_secret" else f"{sec.source} ({how})"
            log.info("signing IDs with the secret from %s: sessions survive restarts", where)

    def _raise_nofile_limit(self) -> None:
        before, now, hard, err = raise_nofile_limit()
        hard_s = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        if err:
            log.warning("RLIMIT_NOFILE (open files): could not raise the soft limit %d to the hard limit %s: %s",
                        before, hard_s, err)
        elif now != before:
            log.info("RLIMIT_NOFILE (open files): soft limit raised from %d to %d (hard limit %s)", before, now, hard_s)
        else:
            log.info("RLIMIT_NOFILE (open files): soft limit %d (hard limit %s)", now, hard_s)

    # -- signals -------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals.append(signum)

    def request_stop(self) -> None:
        self._signals.append(signal.SIGTERM)

    def _stop_if_asked(self) -> None:
        """Raise :class:`_StopDuringStart` when a stop signal arrived (called while starting)."""
        if self._signals:
            raise _StopDuringStart()

    # -- children ------------------------------------------------------------------------
    def _sock_path(self, shard: int) -> str:
        return os.path.join(self.run_dir, f"enc-{shard}.sock")

    def _hb_index(self, spec: ChildSpec) -> int:
        return spec.index if spec.role == "encoder" else self.cfg.shards.count + spec.index

    def _heartbeat_slot(self, spec: ChildSpec) -> Any:
        return None if self.heartbeats is None else self.heartbeats.slot(self._hb_index(spec))

    def _start_encoder(self, spec: ChildSpec) -> mpc.Connection:
        name = segment_name(self.pid, self.run_id, spec.index, spec.incarnation)
        create_segment(name, self.cfg.shards.arena_bytes)
        self.segments.add(name)
        spec.extra["arena"] = name
        parent_conn, child_conn = _CTX.Pipe(duplex=False)
        spec.proc = _CTX.Process(
            target=run_encoder, name=f"shardserver-encoder-{spec.index}", daemon=False,
            args=(self.cfg, spec.index, name, self._sock_path(spec.index), self.engine_url, self.secret,
                  self.run_id, child_conn, self.pid),
            kwargs={"heartbeat": self._heartbeat_slot(spec), "journal_tag": self.journal_tag})
        spec.proc.start()
        spec.started_at = time.monotonic()
        child_conn.close()
        return parent_conn

    def _start_front_end(self, spec: ChildSpec) -> mpc.Connection:
        parent_conn, child_conn = _CTX.Pipe(duplex=False)
        spec.proc = _CTX.Process(
            target=run_front_end, name=f"shardserver-front-end-{spec.index}", daemon=False,
            args=(self.cfg, spec.index, self.sock, [self._sock_path(s) for s in range(self.cfg.shards.count)],
                  self.secret, self.run_id, self.pid, child_conn),
            kwargs={"auth": self.keys, "heartbeat": self._heartbeat_slot(spec)})
        spec.proc.start()
        spec.started_at = time.monotonic()
        child_conn.close()
        return parent_conn

    def _start_sim(self) -> None:
        self.sim_sock = _bind("127.0.0.1", 0, 4096)
        port = self.sim_sock.getsockname()[1]
        self.engine_url = f"http://127.0.0.1:{port}"
        self.sim = ChildSpec("engine-sim", 0)
        self._spawn_sim(self.sim)

    def _spawn_sim(self, spec: ChildSpec) -> None:
        """Start (or restart) the simulator's process on the socket bound by :meth:`_start_sim`."""
        spec.proc = _CTX.Process(target=_run_engine_sim, name="shardserver-engine-sim", args=(dict(self.cfg.simulator),),
                                 kwargs={"sock": self.sim_sock, "log_level": self.cfg.server.log_level,
                                         "parent_pid": self.pid})
        spec.proc.start()
        spec.started_at = time.monotonic()

    def _wait_sim_serving(self) -> None:
        """Block until the embedded simulator answers ``GET /v1/models`` (200), so a gateway that
        reports ready serves at once; its start (imports, token pool) takes 0.5 s idle and several
        seconds on a loaded machine, longer than one engine probe may take.

        Raises:
            StartupError: the simulator exited, or did not answer within ``shards.ready_timeout_s``.
        """
        assert self.sim is not None and self.sim.proc is not None
        deadline = time.monotonic() + self.cfg.shards.ready_timeout_s
        url = self.engine_url + "/v1/models"
        while True:
            self._stop_if_asked()
            if not self.sim.proc.is_alive():
                raise StartupError(f"the engine simulator exited with code {self.sim.proc.exitcode} during start")
            try:
                with urllib.request.urlopen(url, timeout=max(0.1, min(2.0, deadline - time.monotonic()))) as resp:
                    if resp.status == 200:
                        return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise StartupError(f"the engine simulator did not answer GET /v1/models within "
                                   f"{self.cfg.shards.ready_timeout_s} s (shards.ready_timeout_s)")
            time.sleep(0.05)

    def _bind_listener(self) -> socket.socket:
        """Bind ``server.host:server.port``. The address may still be held for a moment by the
        front-ends of a run that just crashed (they get SIGTERM from the kernel when their
        supervisor dies, and close the socket first): EADDRINUSE is retried for
        BIND_RETRY_S seconds before it is a StartupError."""
        cfg = self.cfg.server
        deadline = time.monotonic() + BIND_RETRY_S
        logged = False
        while True:
            try:
                return _bind(cfg.host, cfg.port, cfg.backlog)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE and cfg.port != 0 and time.monotonic() < deadline:
                    if not logged:
                        log.info("%s:%d is in use; retrying for up to %.1f s (the children of a run that just "
                                 "ended may still be closing it)", cfg.host, cfg.port, BIND_RETRY_S)
                        logged = True
                    time.sleep(0.02)
                    continue
                raise StartupError(f"cannot listen on {cfg.host}:{cfg.port} "
                                   f"(server.host / server.port): {exc.strerror or exc}") from None

    def _wait_ready(self, spec: ChildSpec, conn: mpc.Connection) -> None:
        deadline = time.monotonic() + self.cfg.shards.ready_timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StartupError(f"{spec.name} did not report READY within {self.cfg.shards.ready_timeout_s} s "
                                       "(shards.ready_timeout_s)")
                ready = mpc.wait([conn, spec.proc.sentinel], timeout=min(left, _SUPERVISE_WAIT_S))
                self._stop_if_asked()
                if conn in ready:
                    try:
                        conn.recv()
                        if self.heartbeats is not None and spec.role in ("encoder", "front-end"):
                            self.heartbeats.touch(self._hb_index(spec))  # the start is not a stall
                        return
                    except EOFError:
                        pass
                if spec.proc.sentinel in ready or not spec.proc.is_alive():
                    spec.proc.join(1)
                    raise StartupError(f"worker {spec.name} exited with code {spec.proc.exitcode} during start")
        finally:
            conn.close()

    # -- main loop -----------------------------------------------------------------------
    def run(self) -> int:
        """Start everything, supervise until a stop signal, shut down. Returns the exit code."""
        cfg = self.cfg
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            self._log_id_secret()
            self._raise_nofile_limit()
            removed = remove_stale_segments()
            if removed:
                log.info("removed %d shared-memory segments of dead runs", len(removed))
            # ConfigError (exit 2) naming shards.arena_bytes when the arenas cannot fit.
            try:
                needed, free, _ = check_shm_space(cfg.shards.count, cfg.shards.arena_bytes)
                log.info("shared memory: the arenas need %d bytes, %s has %d bytes free", needed, SHM_DIR, free)
            except OSError as exc:
                log.warning("cannot check the free space of %s: %s", SHM_DIR, exc)
            _remove_stale_run_dirs()
            self.run_dir = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{self.pid}-")
            prepare_prometheus_dir(self.run_dir)  # before any child is spawned: they inherit it
            cap = somaxconn()
            if cap is not None and cfg.server.backlog > cap:
                log.warning("server.backlog = %d is above net.core.somaxconn = %d: the kernel caps the listen "
                            "backlog at %d (raise it with: sysctl -w net.core.somaxconn=%d)",
                            cfg.server.backlog, cap, cap, cfg.server.backlog)
            if cfg.futures.pending_ttl_s < cfg.engine.request_cap():
                # A future expires (410) while a live engine may still run it (or hold it queued); the
                # SDK resubmits, and a request the engine always takes that long is resubmitted forever.
                log.warning("futures.pending_ttl_s = %g s is below engine.max_request_s = %g s: a sample the engine "
                            "takes longer than %g s for expires (410) and the SDK resubmits it, again each time; "
                            "raise futures.pending_ttl_s above engine.max_request_s", cfg.futures.pending_ttl_s,
                            cfg.engine.request_cap(), cfg.futures.pending_ttl_s)
            self.sock = self._bind_listener()
            host, port = self.sock.getsockname()[:2]
            self.address = (host, port)
            self.journal_tag = journal_tag(host, port)
            if cfg.uses_simulator:
                self._start_sim()
                self._wait_sim_serving()  # before the encoders, whose first engine probe must find it
            if cfg.server.liveness_timeout_s > 0:
                self.heartbeats = Heartbeats(cfg.shards.count + cfg.server.front_ends)
            self.encoders = [ChildSpec("encoder", s) for s in range(cfg.shards.count)]
            conns = [self._start_encoder(e) for e in self.encoders]
            for e, c in zip(self.encoders, conns):
                self._wait_ready(e, c)
            self.front_ends = [ChildSpec("front-end", i) for i in range(cfg.server.front_ends)]
            fconns = [self._start_front_end(f) for f in self.front_ends]
            for f, c in zip(self.front_ends, fconns):
                self._wait_ready(f, c)
            log.info("shardserver %s listening on http://%s:%d (%d encoders, %d front-ends, engine %s)",
                     self.run_id, host, port, cfg.shards.count, cfg.server.front_ends, mask_url(self.engine_url))
            # Its metrics open their files in the run directory at import: import it now, while
            # the directory is there for sure (later a /tmp cleaner may have removed it).
            from .. import metrics  # noqa: F401

            self._stop_if_asked()
            if self.on_ready is not None:
                self.on_ready(host, port)
            self._supervise()
            return 0
        except StartupError as exc:
            log.error("%s", exc)
            return 1
        except _StopDuringStart:
            log.info("%s arrived while starting: the start is abandoned (never announced ready)",
                     signal.Signals(self._signals[0]).name)
            return 0
        finally:
            self._shutdown()
            for s, h in old_handlers.items():
                signal.signal(s, h)

    def _supervise(self) -> None:
        while not self._signals:
            children = [c for c in (*self.encoders, *self.front_ends, *([self.sim] if self.sim else []))]
            now = time.monotonic()
            for c in children:  # restarts that were held back by the crash-loop backoff
                if c.restart_at and c.restart_at <= now:
                    c.restart_at = 0.0
                    self._restart(c)
            sentinels = {c.proc.sentinel: c for c in children if c.proc is not None and not c.restart_at}
            waited_from = time.monotonic()
            ready = mpc.wait(list(sentinels), timeout=_SUPERVISE_WAIT_S)
            late = time.monotonic() - waited_from - _SUPERVISE_WAIT_S
            if late > SUPERVISOR_STALL_S:
                log.warning("the supervisor did not run for %.1f s (the process group or host was paused): the "
                            "children's heartbeats are judged from now on (server.liveness_timeout_s = %g)",
                            late + _SUPERVISE_WAIT_S, self.cfg.server.liveness_timeout_s)
                self._judge_from = time.monotonic()
            if self._signals:
                break
            for s in ready:
                child = sentinels[s]
                child.proc.join(0.1)
                self._on_exit(child)
            self._check_liveness()
            self._keep_run_dir()

    def _check_liveness(self) -> None:
        """SIGKILL and restart every encoder and front-end whose heartbeat is older than
        ``server.liveness_timeout_s`` (stopped, or its event loop blocked: alive, but holding its
        share of the connections or futures forever).

        After the supervisor was paused with its children (a group SIGSTOP, ``docker pause``: its
        wait in :meth:`_supervise` returned over :data:`SUPERVISOR_STALL_S` late), every child gets
        the full bound again from the resume, instead of being killed, healthy, for the time it
        was frozen with everyone else."""
        bound = self.cfg.server.liveness_timeout_s
        if self.heartbeats is None or bound <= 0:
            return
        from ..metrics import count_worker_hung_kill

        now = time.monotonic()
        for c in (*self.encoders, *self.front_ends):
            if c.proc is None or c.restart_at or c.proc.exitcode is not None:
                continue
            age = min(self.heartbeats.age_s(self._hb_index(c), now), now - self._judge_from)
            if age <= bound:
                continue
            log.error("%s (pid %s) missed its liveness check: no heartbeat for %.1f s (server.liveness_timeout_s = "
                      "%g; stopped, or its event loop blocked): killing it (SIGKILL) and restarting it",
                      c.name, c.proc.pid, age, bound)
            count_worker_hung_kill(c.role)
            c.proc.kill()
            c.proc.join(5)
            self._on_exit(c)

    def _on_exit(self, child: ChildSpec) -> None:
        """A child died: restart it now, or later when it keeps dying right after its start."""
        code = child.proc.exitcode
        lived = time.monotonic() - child.started_at
        child.fast_failures = child.fast_failures + 1 if lived < CRASH_LOOP_WINDOW_S else 0
        delay = 0.0 if child.fast_failures <= 1 else min(0.5 * 2 ** (child.fast_failures - 2), 30.0)
        if delay:
            log.error("%s (pid %s) exited with code %s %.1f s after its start (%d times in a row): "
                      "restarting in %.1f s", child.name, child.proc.pid, code, lived, child.fast_failures, delay)
            child.restart_at = time.monotonic() + delay
            return
        self._restart(child)

    def _keep_id_secret(self) -> None:
        """Write the ID signing secret's file again (same secret) if it was removed with
        ``server.state_dir`` mid-run: otherwise the next start would create a new secret and
        every SDK session and future ID of this run would be refused (404) after a restart.
        WARNING when written, ERROR once while it cannot be."""
        try:
            if restore_secret_file(self.id_secret):
                log.warning("the ID signing secret file %s was removed (with server.state_dir?): written again with "
                            "this run's secret, so sessions survive the next restart", self.id_secret.source)
            self._secret_error_logged = False
        except OSError as exc:
            if not self._secret_error_logged:
                self._secret_error_logged = True
                log.error("the ID signing secret file %s was removed and cannot be written again (%s): the next "
                          "start creates a new secret and the SDK's sessions of this run end", self.id_secret.source,
                          exc.strerror or exc)

    def _keep_run_dir(self, now: float | None = None) -> None:
        """Keep the run directory (control sockets, metrics files) under ``/tmp`` cleaners: every
        :data:`RUN_DIR_CHECK_S` write the ID signing secret's file again if it went with
        ``server.state_dir`` (:meth:`_keep_id_secret`), recreate it if it was removed (the encoders notice their socket
        gone and bind it again, and every process writes its metrics files again:
        :func:`~shardserver.prometheus_dir.restore_removed_files`),
        and every :data:`RUN_DIR_TOUCH_S` touch it and what it holds, so that a cleaner by age
        (systemd-tmpfiles: 10 days in /tmp by default) never finds it old during a long run."""
        now = time.monotonic() if now is None else now
        if not self.run_dir or now < self._run_dir_checked + RUN_DIR_CHECK_S:
            return
        self._run_dir_checked = now
        self._keep_id_secret()
        metrics = os.path.join(self.run_dir, "metrics")
        if not os.path.isdir(metrics):
            try:
                os.makedirs(metrics, mode=0o700, exist_ok=True)
                log.warning("the run directory %s was removed (a /tmp cleaner?): recreated; the encoders bind their "
                            "control sockets again and every process writes its metrics files again", self.run_dir)
            except OSError as exc:
                log.error("the run directory %s was removed and cannot be recreated: %s", self.run_dir, exc)
                return
        try:
            from ..prometheus_dir import restore_removed_files

            restore_removed_files()
        except Exception:  # the metrics must never stop the supervisor
            log.exception("cannot write the supervisor's metrics files again")
        if now >= self._run_dir_touched + RUN_DIR_TOUCH_S:
            self._run_dir_touched = now
            for root, dirs, files in os.walk(self.run_dir):
                for name in (*dirs, *files):
                    try:
                        os.utime(os.path.join(root, name))
                    except OSError:
                        pass
            try:
                os.utime(self.run_dir)
            except OSError:
                pass

    def _restart(self, child: ChildSpec) -> None:
        # Before anything imports shardserver.metrics here (its metrics open files in the
        # run directory at import): a /tmp cleaner may have removed it.
        try:
            os.makedirs(os.path.join(self.run_dir, "metrics"), exist_ok=True)
        except OSError:
            pass  # _respawn reports it and retries
        if child.extra.pop("respawn_retry", False):
            self._respawn(child)  # starting it failed last time: try again
            return
        code = child.proc.exitcode
        child.restarts += 1
        mark_process_dead(child.proc.pid)
        from ..metrics import count_worker_restart

        count_worker_restart(child.role)
        log.warning("%s (pid %s) exited with code %s: restarting (restart #%d)",
                    child.name, child.proc.pid, code, child.restarts)
        if child.role == "encoder":
            old = child.extra.get("arena")
            if old:
                unlink_segment(old)
                self.segments.discard(old)
        elif child.role != "front-end":
            log.error("the engine simulator died (code %s); restarting it", code)
        self._respawn(child)

    def _respawn(self, child: ChildSpec) -> None:
        """Start a dead child again (an encoder with a fresh arena). When that fails with an
        ``OSError`` (an encoder's arena cannot be created because something else filled
        ``/dev/shm``: ENOSPC; ``fork`` failing: ENOMEM, EAGAIN; the run directory cannot be
        recreated), log why and try again after 1, 2, 4 ... 30 s instead of letting the error
        stop the whole gateway; meanwhile an encoder's shard answers 503/410 and the other
        shards serve."""
        conn = None
        try:
            # A /tmp cleaner may have removed the run directory (sockets, metrics files): recreate it.
            os.makedirs(os.path.join(self.run_dir, "metrics"), exist_ok=True)
            if child.role == "encoder":
                child.incarnation += 1
                conn = self._start_encoder(child)
            elif child.role == "front-end":
                conn = self._start_front_end(child)
            else:
                self._spawn_sim(child)
        except OSError as exc:
            made = child.extra.pop("arena", None) if child.role == "encoder" else None
            if made:  # an arena created before the process failed to start is not kept
                unlink_segment(made)
                self.segments.discard(made)
            tries = child.extra.get("respawn_failures", 0) + 1
            child.extra["respawn_failures"] = tries
            delay = min(2.0 ** (tries - 1), 30.0)
            if child.role == "encoder":
                try:
                    free = f"{shm_free_bytes()[0]} bytes free"
                except OSError:
                    free = "free space unknown"
                log.error("%s cannot be restarted: cannot create its arena of %d bytes in %s or start it (%s; %s; "
                          "something else filling it?): retrying in %.1f s", child.name,
                          self.cfg.shards.arena_bytes, SHM_DIR, exc, free, delay)
            else:
                log.error("%s cannot be restarted: %s: retrying in %.1f s", child.name, exc, delay)
            child.extra["respawn_retry"] = True
            child.restart_at = time.monotonic() + delay
            return
        child.extra.pop("respawn_failures", None)
        if conn is not None:
            try:
                self._wait_ready(child, conn)
            except StartupError as exc:
                log.error("%s", exc)

    def _shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        # Stop accepting before anything else. The front-ends close their copies of the
        # listening socket as soon as they get SIGTERM; once this copy is closed too, the kernel
        # refuses new connections (the SDK retries them) instead of queueing them for nobody
        # and resetting them when the last copy goes.
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        log.info("[shutdown] supervisor: stopping front-ends")
        grace = self.cfg.server.graceful_shutdown_s + 2.0
        shutdown_procs([f.proc for f in self.front_ends if f.proc is not None], grace)
        log.info("[shutdown] supervisor: stopping encoders")
        shutdown_procs([e.proc for e in self.encoders if e.proc is not None], 3.0)
        if self.sim is not None and self.sim.proc is not None:
            shutdown_procs([self.sim.proc], 3.0)
        for name in list(self.segments):
            unlink_segment(name)
        self.segments.clear()
        for s in (self.sock, self.sim_sock):
            if s is not None:
                s.close()
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("[shutdown] supervisor: done")
        sys.stderr.flush()
