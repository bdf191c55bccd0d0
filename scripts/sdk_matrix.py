"""Check that several tinker SDK versions sample identically through one gateway.

Usage: .venv/bin/python scripts/sdk_matrix.py [VERSION ...]
(default: 0.15.0 0.20.0 0.24.1 0.25.0 0.26.2 0.33.1 0.38.0). Each version gets its own
virtualenv under .venv-sdk-matrix/ (created once, from PyPI). Not part of `make test`: it
installs seven SDKs. Prints one line per version and whether its results equal 0.38.0's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from shardserver.testing import RunningServer  # noqa: E402

DEFAULT = ["0.15.0", "0.20.0", "0.24.1", "0.25.0", "0.26.2", "0.33.1", "0.38.0"]


def venv_python(version: str) -> str:
    d = REPO / ".venv-sdk-matrix" / version
    py = d / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(d)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", f"tinker=={version}"], check=True)
    return str(py)


def main(versions: list[str]) -> int:
    script = REPO / "tests" / "sdk_scripts" / "sdk_check.py"
    results: dict[str, dict] = {}
    with RunningServer() as server:
        for v in versions:
            proc = subprocess.run([venv_python(v), str(script), server.url], capture_output=True, text=True,
                                  timeout=300, env={**os.environ, "TINKER_TELEMETRY": "0"})
            if proc.returncode != 0:
                print(f"{v}: FAILED\n{proc.stderr[-2000:]}")
                continue
            results[v] = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = results.get("0.38.0") or next(iter(results.values()), None)
    bad = len(versions) - len(results)
    for v, r in results.items():
        same = ref is not None and all(r[k] == ref[k] for k in ("t", "plp", "cl"))
        bad += not same
        print(f"{v}: ok, tokens {r['t'][0][:3]}..., prompt logprobs {r['plp'][:2]}..., "
              f"sample_sequence_ids {'yes' if r['seqids'][0] else 'no (SDK < 0.26)'}, same results: {same}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or DEFAULT))
