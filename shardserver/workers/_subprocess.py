"""Helpers every spawned child runs first: process title, logging, stdin."""

from __future__ import annotations

import logging
import os
import sys

from ..config import Config

__all__ = ["child_setup", "configure_logging"]


def configure_logging(level: str) -> None:
    """Plain ``time level name: message`` lines on stderr, one handler, no Rich."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    root.addHandler(h)
    root.setLevel(level.upper())
    logging.getLogger("shardserver").setLevel(level.upper())


def child_setup(role: str, cfg: Config) -> None:
    """Name the process ``shardserver: <role>`` for ps, set up logging, detach stdin."""
    try:
        import setproctitle

        setproctitle.setproctitle(f"shardserver: {role}")
    except ImportError:  # pragma: no cover - setproctitle is a core dependency
        pass
    configure_logging(cfg.server.log_level)
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
    except OSError:
        pass
