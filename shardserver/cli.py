"""``shardserver`` command line: serve, engine-sim, config, demo, haproxy-config."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from .config import Config, load_config
from .errors import ConfigError

__all__ = ["main", "build_config"]

log = logging.getLogger("shardserver")


def build_config(args: argparse.Namespace) -> Config:
    """The config file (``--config`` or ``$SHARDSERVER_CONFIG``) + environment + command-line flags."""
    cfg = load_config(args.config)
    server = {k: v for k, v in (("host", getattr(args, "host", None)), ("port", getattr(args, "port", None)),
                                ("front_ends", getattr(args, "front_ends", None))) if v is not None}
    if server:
        cfg = cfg.replace("server", **server)
    if getattr(args, "shards", None) is not None:
        cfg = cfg.replace("shards", count=args.shards)
    if getattr(args, "engine_url", None) is not None:
        cfg = cfg.replace("engine", url=args.engine_url)
    return cfg


def _cmd_serve(args: argparse.Namespace) -> int:
    from .process import configure_logging, set_process_title
    from .workers.supervisor import Supervisor

    cfg = build_config(args)
    configure_logging(cfg.server.log_level)
    set_process_title("supervisor")

    def ready(host: str, port: int) -> None:
        # One write: children share this pipe, and print() writes the newline separately when
        # stdout is unbuffered (PYTHONUNBUFFERED), which lets a child's log line land in between.
        sys.stdout.write(f"shardserver ready on http://{host}:{port}\n")
        sys.stdout.flush()

    return Supervisor(cfg, on_ready=ready).run()


def _cmd_engine_sim(args: argparse.Namespace) -> int:
    from .engine_sim import SimConfig, run_process

    cfg = load_config(args.config) if args.config else None
    sim = SimConfig.from_mapping(dict(cfg.simulator)) if cfg else SimConfig()
    run_process(sim, host=args.host, port=args.port)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from .api.auth import load_key_table

    cfg = build_config(args)
    shown = cfg.as_dict(mask_secrets=True)
    # Read the keys as `serve` would (a ConfigError names auth.keys_file); show only their number.
    shown["auth"]["keys_loaded"] = len(load_key_table(cfg.auth))
    print(json.dumps(shown, indent=2, sort_keys=False))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(config_path=args.config, samples=args.samples, tokens=args.tokens,
                    concurrency=args.concurrency)


def _cmd_haproxy_config(args: argparse.Namespace) -> int:
    from .haproxy import parse_host, render_haproxy_config

    try:
        text = render_haproxy_config([parse_host(h) for h in args.host], bind=args.bind, stats_bind=args.stats_bind,
                                     check_interval_ms=args.check_interval_ms, fall=args.fall, rise=args.rise,
                                     maxconn=args.maxconn, timeout_server_s=args.timeout_server_s,
                                     check_timeout_s=args.check_timeout_s)
    except ValueError as exc:
        print(f"shardserver haproxy-config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardserver", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the gateway (supervisor, encoders, front-ends)")
    s.add_argument("--config", help="TOML config file (default: $SHARDSERVER_CONFIG or built-in defaults)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--shards", type=int, help="encoder worker processes (shards.count)")
    s.add_argument("--front-ends", type=int, dest="front_ends", help="uvicorn front-end workers (server.front_ends)")
    s.add_argument("--engine-url", dest="engine_url",
                   help="vLLM base URL, e.g. http://10.0.0.5:8000 (default: the embedded simulator)")
    s.set_defaults(func=_cmd_serve)

    e = sub.add_parser("engine-sim", help="run the vLLM /v1/completions simulator standalone")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=8001)
    e.add_argument("--config", help="take [simulator] from this TOML config")
    e.set_defaults(func=_cmd_engine_sim)

    c = sub.add_parser("config", help="print the effective config (file + environment), secrets masked")
    c.add_argument("--config")
    c.add_argument("--show", action="store_true", help="(default) print the effective config")
    c.set_defaults(func=_cmd_config)

    d = sub.add_parser("demo", help="start the gateway and drive it with the real tinker SDK")
    d.add_argument("--config", default="configs/demo.toml")
    d.add_argument("--samples", type=int, default=256)
    d.add_argument("--tokens", type=int, default=4096)
    d.add_argument("--concurrency", type=int, default=64)
    d.set_defaults(func=_cmd_demo)

    h = sub.add_parser("haproxy-config", help="print an haproxy.cfg for several gateway hosts (docs/MULTI_HOST.md)")
    h.add_argument("--host", action="append", required=True, metavar="HOST_ID=HOST:PORT",
                   help="one gateway host: its server.host_id and address (repeat per host)")
    h.add_argument("--bind", default="0.0.0.0:8080", help="where HAProxy listens for SDK clients")
    h.add_argument("--stats-bind", dest="stats_bind", default="127.0.0.1:8404",
                   help="stats page (/stats) and Prometheus exporter (/metrics) address")
    h.add_argument("--check-interval-ms", dest="check_interval_ms", type=int, default=2000,
                   help="health-check interval per host, ms")
    h.add_argument("--fall", type=int, default=2, help="failed checks before a host is marked down")
    h.add_argument("--rise", type=int, default=2, help="passed checks before a host is marked up again")
    h.add_argument("--maxconn", type=int, default=20000, help="HAProxy's global connection limit")
    h.add_argument("--timeout-server-s", dest="timeout_server_s", type=int, default=60,
                   help="seconds a host may take to answer (> futures.long_poll_s)")
    h.add_argument("--check-timeout-s", dest="check_timeout_s", type=int, default=5,
                   help="seconds a health check waits for /readyz to answer")
    h.set_defaults(func=_cmd_haproxy_config)

    args = p.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"shardserver: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (``shardserver config --show | head``): no traceback. Point
        # stdout at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
