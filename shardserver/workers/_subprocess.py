"""Helpers every spawned child runs first: process title, logging, stdin."""

from __future__ import annotations

import os

from ..config import Config
from ..process import configure_logging, set_process_title

__all__ = ["child_setup", "configure_logging"]


def child_setup(role: str, cfg: Config) -> None:
    """Name the process ``shardserver: <role>`` for ps, set up logging, detach stdin."""
    set_process_title(role)
    configure_logging(cfg.server.log_level)
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
    except OSError:
        pass
