"""prometheus_client in multiprocess mode reads the pid from shardserver's cache (no getpid system
call per metric update), and a forked child still writes files of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_metric_values_use_the_cached_pid_and_a_forked_child_gets_its_own_file(tmp_path) -> None:
    code = textwrap.dedent("""
        import os
        from shardserver import metrics, prometheus_dir
        from prometheus_client import Counter
        c = Counter("t_updates", "test counter", ["k"]).labels(k="x")
        for _ in range(1000):
            c.inc()
        pid = os.fork()
        if pid == 0:
            c.inc(5)
            os._exit(0)
        os.waitpid(pid, 0)
        # The values name their file by the cached pid: a value whose process identifier is the
        # cache writes where the cache says (a real fork() refreshes the cache, as above).
        prometheus_dir._pid[0] = 4242
        c.inc(100)
        print(os.getpid(), pid)
    """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    parent, child = (int(x) for x in out.stdout.split())
    counters = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("counter_"))
    assert counters == sorted([f"counter_{parent}.db", f"counter_{child}.db", "counter_4242.db"])

    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    assert reg.get_sample_value("t_updates_total", {"k": "x"}) == 1000.0 + 5.0 + 100.0
