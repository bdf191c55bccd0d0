"""prometheus_client in multiprocess mode reads the pid from shardserver's cache (no getpid system
call per metric update), and a forked child still writes files of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


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


def test_a_dead_process_s_counts_are_folded_without_changing_a_scrape(tmp_path, monkeypatch):
    """Found by the third break test: every worker restart left its counter and histogram files
    (kept so totals never go backwards), 2 more files per encoder restart, all read by every
    scrape. mark_process_dead now folds them into ``<type>_dead.db`` under the directory's lock:
    the scrape's sums are the same before and after, only the live process's files and the
    folded ones remain, and folding a second dead process adds to the first's. While a scrape
    holds the lock past FOLD_LOCK_WAIT_S the fold gives up (LockBusy: a stopped front-end must
    not stop the supervisor), and the next fold takes those files too."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.mmap_dict import MmapedDict
    from prometheus_client.multiprocess import MultiProcessCollector

    from shardserver import prometheus_dir
    from shardserver.prometheus_dir import LockBusy, files_lock, fold_dead_process

    def key(name: str, labels: dict) -> str:
        return json.dumps([name, name + "_total", labels, "help"], sort_keys=True)

    def write(typ: str, pid, values: dict) -> None:
        m = MmapedDict(str(tmp_path / f"{typ}_{pid}.db"))
        for k, v in values.items():
            m.write_value(k, v, 0.0)
        m.close()

    def scrape() -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(registry, path=str(tmp_path))
        return generate_latest(registry)

    with open("/proc/sys/kernel/pid_max") as f:
        dead1 = int(f.read()) + 1  # above pid_max: never a live process
    dead2 = dead1 + 1
    alive = os.getpid()
    a, b = key("shardserver_x", {"shard": "0"}), key("shardserver_x", {"shard": "1"})
    write("counter", dead1, {a: 3.0, b: 1.0})
    write("counter", dead2, {a: 5.0})
    write("counter", alive, {a: 7.0, b: 2.0})
    before = scrape()
    assert b'shardserver_x_total{shard="0"} 15.0' in before and b'shardserver_x_total{shard="1"} 3.0' in before
    monkeypatch.setattr(prometheus_dir, "FOLD_LOCK_WAIT_S", 0.05)
    with files_lock(str(tmp_path), shared=True):  # a scrape in progress
        with pytest.raises(LockBusy):
            fold_dead_process(dead1, str(tmp_path))
    assert len(list(tmp_path.glob("*.db"))) == 3 and scrape() == before  # nothing moved
    assert fold_dead_process(dead1, str(tmp_path)) == 2  # and dead2's, left by no fold yet
    assert fold_dead_process(dead2, str(tmp_path)) == 0
    assert scrape() == before
    assert sorted(p.name for p in tmp_path.glob("*.db")) == [f"counter_{alive}.db", "counter_dead.db"]
    folded = {k: v for k, v, _t, _p in MmapedDict.read_all_values_from_file(str(tmp_path / "counter_dead.db"))}
    assert folded == {a: 8.0, b: 1.0}
