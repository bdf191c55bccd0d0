"""``python -m shardserver`` runs the same command line as the ``shardserver`` script."""

from __future__ import annotations

import json
import subprocess
import sys

from shardserver.testing import REPO


def test_python_dash_m_shardserver_runs_the_command_line() -> None:
    # A newcomer's first try (and the usual way to run a package without its venv's scripts on
    # PATH) failed: "No module named shardserver.__main__".
    out = subprocess.run([sys.executable, "-m", "shardserver", "config", "--show", "--config",
                          str(REPO / "configs" / "demo.toml")], capture_output=True, text=True, cwd=str(REPO),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert (cfg["server"]["host"], cfg["server"]["port"], cfg["engine"]["url"]) == ("127.0.0.1", 8000, "")
    bad = subprocess.run([sys.executable, "-m", "shardserver", "no-such-command"], capture_output=True, text=True,
                         cwd=str(REPO), timeout=60)
    assert bad.returncode == 2 and "usage: shardserver" in bad.stderr


def test_output_cut_short_by_its_reader_ends_quietly_with_sigpipe_status() -> None:
    """``shardserver config --show | head -1``: the reader closes the pipe before the config is
    written. Before: a BrokenPipeError traceback on stderr and status 1."""
    import os
    import signal

    r, w = os.pipe()
    os.close(r)  # nobody will read: every write fails with EPIPE
    try:
        out = subprocess.run([sys.executable, "-m", "shardserver", "config", "--show", "--config",
                              str(REPO / "configs" / "demo.toml")], stdout=w, stderr=subprocess.PIPE, text=True,
                             cwd=str(REPO), timeout=60)
    finally:
        os.close(w)
    assert (out.returncode, out.stderr) == (128 + signal.SIGPIPE, "")
