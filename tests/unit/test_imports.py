"""What a front-end process loads: aiohttp (~16 MiB of private memory per process at import,
~6.5 MiB net of what the front-end shares with it) is the encoders' engine client and probe for
``https://`` engines only, never the front-ends' (for encoders of an ``http://`` engine see
``tests/e2e/test_engine_faults.py::test_an_https_engine_samples_probes_and_rides_out_the_keepalive_race``)."""

from __future__ import annotations

import subprocess
import sys


def test_a_front_end_does_not_import_aiohttp() -> None:
    code = "import sys, shardserver.workers.frontend; print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr[-2000:]


def test_auth_names_the_connection_scope_key_as_common_does() -> None:
    """shardserver.api.auth keeps its own copy of the scope key (the supervisor imports auth
    without FastAPI); the two must agree or the per-key connection share never applies."""
    from shardserver.api import auth, common

    assert auth.CONNECTION_SCOPE_KEY == common.CONNECTION_SCOPE_KEY
