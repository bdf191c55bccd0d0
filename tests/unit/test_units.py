"""Unit tests: config loading and validation, IDs, arenas, control frames."""

from __future__ import annotations

import asyncio
import os
import random
import time
import zlib

import pytest

from shardserver.config import config_from_mapping, load_config
from shardserver.control import Kind, encode_frame, read_frame
from shardserver.messages import SubmitAccepted, SubmitRequest, decode_reply, decode_request
from shardserver.errors import ConfigError, SlotInvalidError
from shardserver.ids import FutureIdStatus, IdSigner, SamplingSession, shard_of
from shardserver.shm.arena import (
    SUPERBLOCK,
    ArenaReader,
    ArenaWriter,
    create_segment,
    remove_stale_segments,
    segment_name,
    unlink_segment,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- config ------------------------------------------------------------------------------------
def test_shipped_configs_load():
    demo = load_config(os.path.join(REPO, "configs", "demo.toml"), env={})
    assert (demo.shards.count, demo.server.front_ends, demo.engine.url, demo.auth.mode) == (2, 2, "", "open")
    prod = load_config(os.path.join(REPO, "configs", "production.toml"), env={})
    assert (prod.shards.count, prod.auth.mode) == (10, "keys")
    assert prod.engine.url.startswith("http://")


def test_env_overrides_file_values():
    cfg = config_from_mapping({"shards": {"count": 2}}, env={
        "SHARDSERVER_SHARDS__COUNT": "5", "SHARDSERVER_ENGINE__RETRY_5XX": "true",
        "SHARDSERVER_FUTURES__LONG_POLL_S": "10.5", "UNRELATED": "x"})
    assert cfg.shards.count == 5
    assert cfg.engine.retry_5xx is True
    assert cfg.futures.long_poll_s == 10.5


@pytest.mark.parametrize("data,env,key", [
    ({"shards": {"count": 0}}, {}, "shards.count"),
    ({"shards": {"count": "two"}}, {}, "shards.count"),
    ({"shards": {"bogus": 1}}, {}, "shards.bogus"),
    ({"nosuch": {}}, {}, "nosuch"),
    ({}, {"SHARDSERVER_FUTURES__LONG_POLL_S": "60"}, "futures.long_poll_s"),
    ({}, {"SHARDSERVER_SERVER__PORT": "http"}, "server.port"),
    ({"engine": {"url": "ftp://x"}}, {}, "engine.url"),
    ({"auth": {"mode": "maybe"}}, {}, "auth.mode"),
    ({"server": {"access_log": "yes"}}, {}, "server.access_log"),
    ({"engine": {"pool_idle_s": 0}}, {}, "engine.pool_idle_s"),
    ({"engine": {"pool_wait_s": -1}}, {}, "engine.pool_wait_s"),
    ({}, {"SHARDSERVER_ENGINE__UNAVAILABLE_BUDGET_S": "0"}, "engine.unavailable_budget_s"),
    ({"engine": {"connect_retries": 2}}, {}, "engine.connect_retries"),
    ({"engine": {"url": "http://u:p@h:8000", "api_key": "sk-1"}}, {}, "engine.api_key"),
    ({}, {"SHARDSERVER_ENGINE__API_KEY": "sk-1\n"}, "engine.api_key"),
    ({"engine": {"timeout_s": 900, "max_request_s": 600}}, {}, "engine.max_request_s"),
    ({"engine": {"dead_connection_s": 1}}, {}, "engine.dead_connection_s"),
    ({"engine": {"bad_body_resends": 11}}, {}, "engine.bad_body_resends"),
])
def test_invalid_config_names_the_key(data, env, key):
    with pytest.raises(ConfigError) as ei:
        config_from_mapping(data, env=env)
    assert ei.value.key == key
    assert key in str(ei.value)


@pytest.mark.parametrize("key", ["futures.pending_ttl_s", "futures.retrieved_ttl_s", "futures.completed_ttl_s",
                                 "server.keep_alive_s", "engine.timeout_s", "shards.ready_timeout_s"])
@pytest.mark.parametrize("how", ["toml inf", "toml nan", "env inf", "env -inf"])
def test_a_non_finite_number_is_refused_naming_the_key(key, how, tmp_path):
    """Found by a break test: ``futures.pending_ttl_s = inf`` (valid TOML) passed every range check
    (inf > 0), the gateway started and /readyz said 200, and every asample answered 500 "cannot
    convert float NaN to integer" (the TTL wheel); ``server.keep_alive_s = inf`` killed the
    front-ends with OverflowError. Every float key takes finite numbers only."""
    section, name = key.split(".")
    if how.startswith("toml"):
        path = tmp_path / "c.toml"
        path.write_text(f"[{section}]\n{name} = {how.split()[1]}\n")
        with pytest.raises(ConfigError) as ei:
            load_config(path, env={})
    else:
        with pytest.raises(ConfigError) as ei:
            config_from_mapping({}, env={f"SHARDSERVER_{section.upper()}__{name.upper()}": how.split()[1]})
    assert ei.value.key == key
    assert str(ei.value).endswith(f"expected a finite number, got {float(how.split()[1])!r}" if how.startswith("toml")
                                  else f"expected a finite number, got {how.split()[1]!r}"), str(ei.value)


@pytest.mark.parametrize("env,key,message", [
    ({"SHARDSERVER_SHARDS__READY_TIMEOUT_S": "1e300"}, "shards.ready_timeout_s", "must be at most 1e+09 s (got 1e+300)"),
    ({"SHARDSERVER_FUTURES__LONG_POLL_S": "2e9"}, "futures.long_poll_s", "must be at most 1e+09 s (got 2000000000.0)"),
    ({"SHARDSERVER_SERVER__BACKLOG": "10000000000"}, "server.backlog",
     "must be in 1..65535 (the kernel caps it at net.core.somaxconn) (got 10000000000)"),
])
def test_a_value_that_would_overflow_at_start_is_refused_naming_the_key(env, key, message):
    """Found by the fourth break test: ``shards.ready_timeout_s = 1e300`` and ``server.backlog =
    1e10`` passed validation, then stopped the gateway at start with a raw OverflowError
    (``timestamp too large``, ``sock.listen``). Durations are capped at MAX_SECONDS, the backlog
    at 65535."""
    with pytest.raises(ConfigError) as ei:
        config_from_mapping({}, env=env)
    assert ei.value.key == key and str(ei.value).endswith(message), str(ei.value)


def test_max_request_s_follows_a_long_timeout_unless_set():
    """Found by a break test: ``engine.max_request_s`` (new, must be >= ``engine.timeout_s``) with a
    fixed 4 h default refused a config that only set ``timeout_s = 20000``. Its default, 0, is
    max(4 h, timeout_s)."""
    assert config_from_mapping({"engine": {"timeout_s": 20000}}, env={}).engine.request_cap() == 20000
    assert config_from_mapping({}, env={}).engine.request_cap() == 14400
    assert config_from_mapping({"engine": {"max_request_s": 900}}, env={}).engine.request_cap() == 900


@pytest.mark.parametrize("url", ["http://", "http://127.0.0.1:99999", "ftp://h", "http://h:8000/x?y=1", "h:8000"])
def test_invalid_engine_urls(url):
    with pytest.raises(ConfigError) as ei:
        config_from_mapping({"engine": {"url": url}}, env={})
    assert ei.value.key == "engine.url"


def test_engine_url_helpers():
    from shardserver.config import engine_base_url, mask_url, mask_urls_in

    assert engine_base_url("http://h:8000/v1/") == "http://h:8000"
    assert engine_base_url("http://h:8000/router") == "http://h:8000/router"
    assert mask_url("http://bob:pw@h:1/v1") == "http://***@h:1/v1"
    assert mask_urls_in("Cannot connect to host http://bob:pw@h:1/x ssl") == "Cannot connect to host http://***@h:1/x ssl"
    shown = config_from_mapping({"engine": {"url": "http://bob:pw@h:1"}}, env={}).as_dict()
    assert shown["engine"]["url"] == "http://***@h:1"


def test_answer_budget_default_depends_on_the_engine_scheme():
    """engine.answer_budget_bytes = -1 (the default): 16 MiB of answers read ahead of the decoder
    for http:// engines (a body past it waits in the kernel), 64 MiB for https:// (where the
    budget holds engine calls back); a value set is used as it is; below -1 is refused."""
    e = config_from_mapping({}, env={}).engine
    assert e.answer_budget_bytes == -1
    assert e.answer_budget("http://127.0.0.1:8000/v1/completions") == 16 * 1024 * 1024
    assert e.answer_budget("https://vllm.example:443/v1/completions") == 64 * 1024 * 1024
    e = config_from_mapping({"engine": {"answer_budget_bytes": 0}}, env={}).engine
    assert e.answer_budget("http://127.0.0.1:8000") == 0
    e = config_from_mapping({}, env={"SHARDSERVER_ENGINE__ANSWER_BUDGET_BYTES": "67108864"}).engine
    assert e.answer_budget("http://127.0.0.1:8000") == 64 * 1024 * 1024
    with pytest.raises(ConfigError) as ei:
        config_from_mapping({"engine": {"answer_budget_bytes": -2}}, env={})
    assert "engine.answer_budget_bytes" in str(ei.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path / "nope.toml", env={})
    assert "does not exist" in str(ei.value)
    bad = tmp_path / "bad.toml"
    bad.write_text("[shards\ncount = 1")
    with pytest.raises(ConfigError) as ei:
        load_config(bad, env={})
    assert "invalid TOML" in str(ei.value)


# -- IDs ---------------------------------------------------------------------------------------
def test_future_ids_hash_to_their_shard_and_verify():
    s = IdSigner(b"k" * 32, "0a1b2c3d")
    for shard in range(4):
        fid = s.mint_future_id(shard, 4)
        assert shard_of(fid, 4) == shard
        assert len(fid.split("-")[2]) == 32  # 128 random bits (after the host part)
        assert s.check_future_id(fid) == FutureIdStatus.OK
        assert s.check_future_id(fid, owner="other-key") == FutureIdStatus.INVALID
    other = IdSigner(b"k" * 32, "ffffffff")
    assert other.check_future_id(s.mint_future_id(0, 1)) == FutureIdStatus.FOREIGN_RUN
    assert s.check_future_id("garbage") == FutureIdStatus.INVALID
    assert s.check_future_id(17) == FutureIdStatus.INVALID


def test_sampling_session_ids_carry_the_model():
    s = IdSigner(b"secret", "00000001")
    sid = s.mint_session_id()
    assert s.check_session_id(sid)
    ss = s.mint_sampling_session_id(SamplingSession(sid, "Qwen/Qwen3-8B", None, 3))
    got = s.open_sampling_session_id(ss)
    assert got is not None and (got.base_model, got.model_path, got.seq) == ("Qwen/Qwen3-8B", None, 3)
    assert s.open_sampling_session_id(ss[:-1] + ("0" if ss[-1] != "0" else "1")) is None
    assert IdSigner(b"other", "00000001").open_sampling_session_id(ss) is None


def test_opened_sampling_session_ids_are_remembered_per_owner():
    """IdSigner remembers IDs it opened (issue 12 item 2: no MAC per asample), keyed by ID and
    owner: another key's use of the ID is still refused, a tampered ID still fails, and the
    memory starts over at OPENED_CACHE_SIZE."""
    from shardserver.ids import OPENED_CACHE_SIZE

    s = IdSigner(b"secret", "00000001")
    ss = s.mint_sampling_session_id(SamplingSession("s-x", "Qwen/Qwen3-8B", None, 3), owner="key-a")
    first = s.open_sampling_session_id(ss, "key-a")
    assert first is not None and s.open_sampling_session_id(ss, "key-a") is first
    assert s.open_sampling_session_id(ss, "key-b") is None
    assert s.open_sampling_session_id(ss[:-1] + ("0" if ss[-1] != "0" else "1"), "key-a") is None
    for i in range(OPENED_CACHE_SIZE):
        assert s.open_sampling_session_id(
            s.mint_sampling_session_id(SamplingSession("s-y", None, "p", i), owner="key-a"), "key-a").seq == i
    assert len(s._opened) <= OPENED_CACHE_SIZE
    again = s.open_sampling_session_id(ss, "key-a")
    assert again == first and s.open_sampling_session_id(ss, "key-b") is None


# -- arenas ------------------------------------------------------------------------------------
@pytest.fixture
def arena():
    name = segment_name(os.getpid(), "7e57a7e5", random.randrange(10**6), 0)
    create_segment(name, 1 << 20)
    w = ArenaWriter(name)
    r = ArenaReader(name)
    yield w, r
    r.close()
    w.close()
    unlink_segment(name)


def test_arena_view_is_no_copy_and_valid_tells_reuse(arena):
    """ArenaReader.view: the slot's bytes without a copy (issue 12 item 2); valid() is False once
    the slot was freed, and stays False after the space is reused (generations never repeat);
    close() with a view still alive does not raise (the mapping goes with the last view)."""
    w, r = arena
    s1 = w.write(b"A" * 100)
    off, gen1 = s1.offset, s1.generation
    v = r.view(off, 100, gen1)
    assert v.readonly and v.tobytes() == b"A" * 100 and r.valid(off, gen1)
    w.free(s1)
    assert not r.valid(off, gen1)
    s2 = w.write(b"B" * 100)
    assert s2.offset == off and s2.generation != gen1
    assert v.tobytes() == b"B" * 100  # the view reads the arena itself: reuse shows through ...
    assert not r.valid(off, gen1)  # ... and the generation check catches it
    with pytest.raises(SlotInvalidError, match="modified or invalid"):
        r.view(off, 100, gen1)
    with pytest.raises(SlotInvalidError, match="outside arena"):
        r.view(r.size, 100, s2.generation)
    r.close()  # a view is alive: no BufferError
    assert v.tobytes() == b"B" * 100
    v.release()


def test_arena_write_read_free(arena):
    w, r = arena
    s1 = w.write(b"hello world")
    assert s1 is not None and s1.offset == SUPERBLOCK and s1.length == 11
    assert r.read(s1.offset, 11, s1.generation) == b"hello world"
    assert w.used_bytes == 64
    gen = s1.generation
    w.free(s1)
    assert w.used_bytes == 0
    with pytest.raises(SlotInvalidError, match="modified or invalid"):
        r.read(SUPERBLOCK, 11, gen)
    s2 = w.write(b"again")
    assert s2.offset == SUPERBLOCK and s2.generation != gen
    with pytest.raises(SlotInvalidError):
        r.read(s2.offset, 11, gen)


def test_arena_full_and_coalescing(arena):
    w, _ = arena
    slots = [w.write(bytes([i % 256]) * 1000) for i in range(1100)]
    live = [s for s in slots if s is not None]
    assert len(live) == (1 << 20) // 1024
    assert w.alloc(1000) is None
    for s in live[::2]:
        w.free(s)
    assert w.alloc(3000) is None  # free space is fragmented into 1024-byte holes
    for s in live[1::2]:
        w.free(s)
    assert w.used_bytes == 0 and w.largest_free() == 1 << 20
    assert w.alloc((1 << 20) - 16) is not None


class _ListFirstFit:
    """Reference allocator for the test below: address-ordered first fit over one sorted list
    of free blocks, walked from the lowest (what ArenaWriter.alloc did before its size classes)."""

    def __init__(self, size: int) -> None:
        self.free = [[SUPERBLOCK, size]]  # [offset, size], ascending offsets, coalesced

    def alloc(self, need: int) -> int:
        for i, (off, sz) in enumerate(self.free):
            if sz >= need:
                if sz == need:
                    del self.free[i]
                else:
                    self.free[i] = [off + need, sz - need]
                return off
        return -1

    def give_back(self, off: int, size: int) -> None:
        self.free.append([off, size])
        self.free.sort()
        merged = [self.free[0]]
        for o, sz in self.free[1:]:
            if merged[-1][0] + merged[-1][1] == o:
                merged[-1][1] += sz
            else:
                merged.append([o, sz])
        self.free = merged


def test_arena_alloc_is_address_ordered_first_fit_under_random_churn(arena):
    """ArenaWriter.alloc finds its block through size classes (so the small tails shrink() gives
    back after each result are not walked at every SUBMIT); the blocks it picks are exactly those
    of a plain first-fit walk over the free list, through 6000 random reserve / shrink / free
    steps of payloads from 1 byte to 256 KiB in a 1 MiB arena, and largest_free() and the free
    list agree with it after every step."""
    w, _ = arena
    ref = _ListFirstFit(w.size)
    rng = random.Random(12)
    live: list = []
    for _ in range(6000):
        r = rng.random()
        if live and (r < 0.35 or w.used_bytes > w.size * 0.9):
            s = live.pop(rng.randrange(len(live)))
            w.free(s)
            ref.give_back(s.offset, s.capacity)
        else:
            payload = rng.choice((rng.randrange(1, 200), rng.randrange(1, 5000), rng.randrange(1, 70_000),
                                  rng.randrange(1, 1 << 18)))
            s = w.alloc(payload)
            off = ref.alloc(w.slot_bytes(payload))
            assert (s.offset if s is not None else -1) == off
            if s is not None:
                if rng.random() < 0.6:  # a result smaller than its reservation
                    keep = rng.randrange(0, payload + 1)
                    cap = s.capacity
                    w.shrink(s, keep)
                    if s.capacity < cap:
                        ref.give_back(s.offset + s.capacity, cap - s.capacity)
                live.append(s)
        assert [[o, w._free_size[o]] for o in w._free_offs] == ref.free
        assert w.largest_free() == max((sz for _, sz in ref.free), default=0)
    for s in live:
        w.free(s)
    assert w.used_bytes == 0 and w.largest_free() == w.size and w._free_offs == [SUPERBLOCK]


def test_arena_packs_slots_low_so_the_pages_written_follow_the_peak_in_use(arena):
    """A FIFO of at most 8 live results of ~10 KB (peak in use ~82 KB) cycled 2000 times
    through a 1 MiB arena: every slot lies within the first 2 x peak bytes, so tmpfs keeps about
    the peak resident. Next fit walked the whole arena (highest end = 1 MiB; soak-131k: PSS grew
    to the arena's size while a third of it was in use)."""
    w, _ = arena
    rng = random.Random(5)
    live: list = []
    peak = highest = 0
    for i in range(2000):
        if len(live) == 8:
            w.free(live.pop(0))
        s = w.write(bytes([i % 256]) * rng.randrange(8_000, 12_000))
        assert s is not None
        live.append(s)
        peak = max(peak, w.used_bytes)
        highest = max(highest, s.offset + s.capacity)
    assert peak <= 8 * w.slot_bytes(12_000)
    assert highest <= 2 * peak, (highest, peak)


def test_arena_free_gives_the_pages_of_a_freed_slot_back_to_tmpfs(arena):
    """tmpfs keeps every page ever written: a freed slot's whole pages are punched out
    (MADV_REMOVE), so the segment's resident pages follow the results in use, not every byte
    ever reserved and written (soak-131k poller: 6.4 GiB of PSS for 271 MiB of results). Pages
    shared with a live neighbour stay; readers of a punched slot see generation 0 (freed)."""
    w, r = arena
    path = os.path.join("/dev/shm", w.name)
    resident = lambda: os.stat(path).st_blocks * 512  # noqa: E731 - bytes tmpfs holds for the segment
    base = resident()
    slots = [w.write(bytes([i + 1]) * 200_000) for i in range(4)]  # 4 x ~200 KB, contiguous from offset 64
    assert all(s is not None for s in slots)
    written = resident() - base
    end = slots[3].offset + 16 + 200_000  # the last byte written; page 0 (superblock) was resident before
    assert written == (-(-end // 4096) - 1) * 4096
    gen1 = slots[1].generation
    w.free(slots[1])  # both neighbours live: only the pages wholly inside it go
    cap = slots[1].capacity
    lo, hi = slots[1].offset, slots[1].offset + cap
    inner = (hi // 4096 - -(-lo // 4096)) * 4096
    assert w.released_bytes == inner and resident() == base + written - inner
    with pytest.raises(SlotInvalidError):
        r.read(lo, slots[1].length, gen1)
    w.free(slots[2])  # coalesces with the free slot 1: the page they shared goes too
    lo2 = -(-slots[1].offset // 4096) * 4096
    hi2 = slots[3].offset // 4096 * 4096
    assert w.released_bytes == hi2 - lo2 and resident() == base + written - (hi2 - lo2)
    assert r.read(slots[0].offset, 200_000, slots[0].generation) == b"\x01" * 200_000
    assert r.read(slots[3].offset, 200_000, slots[3].generation) == b"\x04" * 200_000
    s = w.write(b"\x09" * 300_000)  # the punched range is reused like any free space
    assert s.offset == slots[1].offset and r.read(s.offset, 300_000, s.generation) == b"\x09" * 300_000


def test_arena_random_reuse_keeps_every_checksum(arena):
    """Seeded random alloc/free churn: every live slot always reads back its own bytes."""
    w, r = arena
    rng = random.Random(1234)
    live: dict[int, tuple] = {}
    for step in range(3000):
        if live and (rng.random() < 0.45 or w.free_bytes < 100_000):
            key = rng.choice(list(live))
            slot, crc = live.pop(key)
            w.free(slot)
        else:
            data = rng.randbytes(rng.randrange(0, 20_000))
            slot = w.write(data)
            if slot is not None:
                live[step] = (slot, zlib.crc32(data))
        for slot, crc in list(live.values())[:3]:
            assert zlib.crc32(r.read(slot.offset, slot.length, slot.generation)) == crc, f"seed 1234 step {step}"
    offs = sorted((s.offset, s.capacity) for s, _ in live.values())
    for (a, ca), (b, _) in zip(offs, offs[1:]):
        assert a + ca <= b, "overlapping slots"


def _start_ticks(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat: the process's start time in clock ticks since boot."""
    return int(open(f"/proc/{pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[19])


def test_remove_stale_segments_only_removes_dead_runs():
    """Segments of a live process stay, whatever its command line (a test run's ``python -m
    pytest`` creates arenas too); those of a missing pid, of a zombie, or of a pid now used by
    a process that started after the segment was made (pid reuse: told by the owner's start
    time in the superblock, or, for a segment without one, by its mtime) go."""
    import subprocess
    import sys

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "shardserver-test"])
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # no "shardserver"
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass", "shardserver-test"])
    dead_pid = 2 ** 22 + 12345  # above pid_max on default kernels: never alive
    run = f"{random.randrange(16 ** 8):08x}"  # this run's: another run of this test may overlap
    names = {"live": segment_name(live.pid, run, 0, 0), "dead": segment_name(dead_pid, run, 0, 0),
             "plain": segment_name(plain.pid, run, 0, 0),
             "plain-old-format": segment_name(plain.pid, run, 1, 0),
             "reused": segment_name(later.pid, run, 0, 0),
             "reused-old-format": segment_name(later.pid, run, 1, 0),
             "zombie": segment_name(zombie.pid, run, 0, 0)}
    try:
        for n in names.values():
            create_segment(n, 4096)
        # The pids' owners as the superblock records them: the process named, or (pid reuse)
        # an earlier process, here this test's own, older than `later` (it spawned it).
        older = _start_ticks(os.getpid())
        assert older < _start_ticks(later.pid)
        with open(f"/dev/shm/{names['live']}", "rb") as f:
            assert f.read(24)[16:] == _start_ticks(live.pid).to_bytes(8, "little")
        with open(f"/dev/shm/{names['reused']}", "r+b") as f:
            f.seek(16)
            f.write(older.to_bytes(8, "little"))
        # Segments of the version before the owner's start time (bytes 16..24 zero): judged
        # by their mtime; the reused one was last written 60 s before `later` started.
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime "))
        later_started = boot + _start_ticks(later.pid) / os.sysconf("SC_CLK_TCK")
        for k in ("plain-old-format", "reused-old-format"):
            with open(f"/dev/shm/{names[k]}", "r+b") as f:
                f.seek(16)
                f.write(bytes(8))
        os.utime(f"/dev/shm/{names['reused-old-format']}", (later_started - 60, later_started - 60))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and b") Z" not in open(f"/proc/{zombie.pid}/stat", "rb").read():
            time.sleep(0.02)  # exited but not waited for: a zombie
        removed = remove_stale_segments()
        for k in ("live", "plain", "plain-old-format"):
            assert names[k] not in removed and os.path.exists(f"/dev/shm/{names[k]}"), k
        # Gone: removed here, or by another run of this test (or a gateway) starting meanwhile.
        for k in ("dead", "zombie", "reused", "reused-old-format"):
            assert not os.path.exists(f"/dev/shm/{names[k]}"), k
        assert {n for n in removed if f"-{run}-" in n} <= {
            names[k] for k in ("dead", "zombie", "reused", "reused-old-format")}
    finally:
        for n in names.values():
            unlink_segment(n)
        for p in (live, plain, later):
            p.kill()
            p.wait()
        zombie.wait()


# -- control frames ----------------------------------------------------------------------------
def test_control_frame_roundtrip():
    async def go():
        r = asyncio.StreamReader()
        r.feed_data(encode_frame(Kind.SUBMIT, 7, SubmitRequest(sid="a", seq=1, n=1, reserve_bytes=64), b"\x00body"))
        r.feed_data(encode_frame(Kind.REPLY, 7, SubmitAccepted(request_id="x")))
        r.feed_eof()
        return await read_frame(r), await read_frame(r)

    a, b = asyncio.run(go())
    assert (a.kind, a.tag, a.blob) == (Kind.SUBMIT, 7, b"\x00body")
    req = decode_request(a.kind, a.meta)
    assert (req.sid, req.seq) == ("a", 1)
    assert (b.kind, b.tag, b.blob) == (Kind.REPLY, 7, b"")
    assert decode_reply(Kind.SUBMIT, b.meta) == SubmitAccepted(request_id="x")


def _churn_writer(name: str, conn, seconds: float) -> None:
    """Child process: keep freeing and rewriting slots at the same offsets, publish each slot."""
    import time as _t

    w = ArenaWriter(name)
    rng = random.Random(7)
    live = []
    deadline = _t.monotonic() + seconds
    n = 0
    while _t.monotonic() < deadline:
        if len(live) >= 8:
            w.free(live.pop(0))
        data = rng.randbytes(rng.randrange(1000, 60_000))
        slot = w.write(zlib.crc32(data).to_bytes(4, "little") + data)
        if slot is not None:
            live.append(slot)
            conn.send((slot.offset, slot.length, slot.generation))
            n += 1
    conn.send(None)
    conn.close()
    w.close()


def test_reader_never_returns_bytes_of_a_reused_slot():
    """A writer process reuses slots as fast as it can while this process reads them: every read
    either returns the exact bytes that were committed (CRC matches) or raises SlotInvalidError."""
    import multiprocessing as mp

    name = segment_name(os.getpid(), "5e910c4d", random.randrange(10**6), 0)
    create_segment(name, 256 * 1024)  # small: offsets are reused constantly
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_churn_writer, args=(name, child, 2.0))
    proc.start()
    child.close()
    r = ArenaReader(name)
    ok = invalid = 0
    try:
        while True:
            if not parent.poll(10):
                raise AssertionError("writer process stopped publishing")
            item = parent.recv()
            if item is None:
                break
            off, length, gen = item
            for _ in range(3):  # read the same slot a few times while the writer moves on
                try:
                    data = r.read(off, length, gen)
                except SlotInvalidError:
                    invalid += 1
                    break
                assert int.from_bytes(data[:4], "little") == zlib.crc32(data[4:]), "corrupt read"
                ok += 1
    finally:
        proc.join(10)
        r.close()
        unlink_segment(name)
    assert proc.exitcode == 0
    print(f"reads ok {ok}, invalidated {invalid}")
    assert ok > 100 and invalid > 10, (ok, invalid)


def test_rate_limited_log_keeps_each_kind_apart_and_flushes_what_it_folded() -> None:
    """The front-end's rate-limited connection log (``http_conn.RateLimitedLog``). Before: one
    instance served header timeouts and 431s, so 19 timeouts were reported as 431s ("20 times in
    the last 10 s" for a 15 s window), and events folded into no line were never logged."""
    import logging

    from shardserver.workers.http_conn import RateLimitedLog

    lines: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("test.ratelimited")
    logger.propagate = False
    logger.addHandler(Grab())
    rl = RateLimitedLog(logger, logging.WARNING, interval_s=1.0)

    async def main() -> None:
        for i in range(3):
            rl.hit("timeout on connection %d", i)
        rl.hit("431 on connection %d", 9)
        assert lines == ["timeout on connection 0", "431 on connection 9"]
        await asyncio.sleep(1.3)  # no further event: the two folded timeouts are logged anyway
        assert lines[2:] == ["timeout on connection 2 (2 times in the last 1 s)"]
        rl.hit("timeout on connection %d", 5)  # a new window: folded, then flushed alone
        await asyncio.sleep(1.2)
        assert lines[3:] == ["timeout on connection 5"]

    asyncio.run(main())
    assert len(lines) == 4


def _gateway_protocol_factory(loop: asyncio.AbstractEventLoop, made: list, listener=None, **limits):
    """A factory of real :class:`GatewayHttpProtocol` instances (uvicorn config, a tiny ASGI app
    answering 200 ``ok``; ``limits``: more :class:`ConnectionLimits` fields); each instance is
    appended to ``made``."""
    import uvicorn
    from uvicorn.server import ServerState

    from shardserver.workers.http_conn import ConnectionLimits, GatewayHttpProtocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    config.load()
    state = ServerState()

    def factory():
        proto = GatewayHttpProtocol(config=config, server_state=state, app_state={}, _loop=loop,
                                    limits=ConnectionLimits(header_timeout_s=30, body_timeout_s=30, **limits),
                                    listener=listener)
        made.append(proto)
        return proto

    return factory


async def _recv_until(client, end: bytes, tries: int = 200) -> bytes:
    """Read a non-blocking client socket every 10 ms until the bytes end with ``end``, it is
    closed, or ``tries`` reads; returns what arrived (ConnectionResetError propagates)."""
    got = b""
    for _ in range(tries):
        await asyncio.sleep(0.01)
        try:
            chunk = client.recv(65536)
        except BlockingIOError:
            continue
        if not chunk:
            break
        got += chunk
        if got.endswith(end):
            break
    return got


@pytest.mark.parametrize("timer", ["drain", "keep-alive"])
def test_an_idle_timer_does_not_reset_a_request_already_in_the_socket(timer):
    """Found by CI (tests/e2e/test_frontend_drain.py, once in ~10 runs on 2 CPUs): a request sent on
    an idle keep-alive connection during the drain was reset when the front-end's event loop had
    been busy past DRAIN_IDLE_S. The loop then ran the due drain timer before reading the socket,
    and closing a socket with unread bytes sends RST. Here the timer fires (``_on_timeout``) with a
    request waiting unread, as it does then: the request must be answered, with Connection: close.
    uvicorn's keep-alive timeout (``server.keep_alive_s``) had the same race: the request is
    answered and the connection stays open."""
    import array
    import fcntl
    import socket as socketlib
    import termios

    uvloop = pytest.importorskip("uvloop")
    made: list = []

    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_gateway_protocol_factory(loop, made), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = socketlib.create_connection(("127.0.0.1", port))
        client.setblocking(False)
        req = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"
        try:
            client.sendall(req)
            first = await _recv_until(client, b"ok")
            assert first.startswith(b"HTTP/1.1 200 ") and b"connection: close" not in first.lower()
            (proto,) = made
            if timer == "drain":
                proto.begin_drain()  # idle: its drain timer runs (DRAIN_IDLE_S)
            client.sendall(req)  # in the server's socket at once (loopback); the loop has not read it
            waiting = array.array("i", [0])
            fcntl.ioctl(proto.transport.get_extra_info("socket").fileno(), termios.FIONREAD, waiting, True)
            assert waiting[0] == len(req)
            if timer == "drain":
                proto._on_timeout()  # the drain timer, due first (the loop ran timers before reads)
            else:
                proto.timeout_keep_alive_task.cancel()
                proto.timeout_keep_alive_handler()  # uvicorn's keep-alive timer, due first
            return await _recv_until(client, b"ok")
        finally:
            client.close()
            server.close()
            await server.wait_closed()

    got = uvloop.run(main()) if hasattr(uvloop, "run") else asyncio.run(main())
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\nok"), got
    assert (b"connection: close" in got.lower()) == (timer == "drain")


def test_an_idle_connection_whose_next_request_waits_unread_is_not_evicted(monkeypatch):
    """At the cap, the listener evicts the longest-idle keep-alive connection to make room. One
    whose next request already sits unread in its socket (the loop handles the listening socket
    first in the same turn) is not idle: evicting it reset that request. It is passed over; its
    request is answered."""
    import socket as socketlib

    from shardserver.workers import http_conn

    uvloop = pytest.importorskip("uvloop")
    monkeypatch.setattr(http_conn, "EVICT_MIN_IDLE_S", 0.05)
    made: list = []

    async def main() -> tuple[object, bytes]:
        loop = asyncio.get_running_loop()
        lsock = socketlib.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(16)
        lsock.setblocking(False)
        listener = http_conn.Listener(lsock, max_connections=1)
        listener.start(_gateway_protocol_factory(loop, made, listener))
        client = socketlib.create_connection(lsock.getsockname())
        client.setblocking(False)
        req = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"
        try:
            client.sendall(req)
            assert (await _recv_until(client, b"ok")).startswith(b"HTTP/1.1 200 ")
            await asyncio.sleep(0.1)  # idle past EVICT_MIN_IDLE_S
            assert listener._evictable() is made[0]
            client.sendall(req)  # its next request, unread
            victim = listener._evictable()
            return victim, await _recv_until(client, b"ok")
        finally:
            client.close()
            listener.close()
            await listener.wait_closed()
            lsock.close()

    victim, got = uvloop.run(main()) if hasattr(uvloop, "run") else asyncio.run(main())
    assert victim is None
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\nok"), got


class _SlotRewrittenAfterCheck:
    """An arena reader whose slot the encoder frees and fills with another result (``B``) right
    after the front-end's first check: what a front-end stopped between its check and its copy
    for longer than ARENA_READ_HOLD_S would see."""

    def __init__(self, slot: bytearray) -> None:
        self.slot, self.checks = slot, 0

    def valid(self, offset: int, generation: int) -> bool:
        self.checks += 1
        if self.checks == 1:
            self.slot[:] = b"B" * len(self.slot)
            return True
        return False


@pytest.mark.parametrize("private", [True, False])
def test_keys_mode_sends_a_private_copy_checked_after_it_was_taken(private):
    """Under ``auth.mode = keys`` (ConnectionLimits.private_arena_copy) write_arena copies a
    result's piece out of the arena first and checks the slot after the copy (a seqlock read), so
    a slot freed and rewritten after the check cannot put another tenant's bytes on the wire.
    Without it (open mode, one tenant) the bytes go straight from the arena: the rewrite after
    the check reaches the client, which is why keys mode pays for the copy."""
    import socket as socketlib

    uvloop = pytest.importorskip("uvloop")
    made: list = []

    async def main() -> tuple[bytes, bool]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_gateway_protocol_factory(loop, made, private_arena_copy=private),
                                          "127.0.0.1", 0)
        client = socketlib.create_connection(server.sockets[0].getsockname())
        client.setblocking(False)
        try:
            for _ in range(100):
                if made:
                    break
                await asyncio.sleep(0.01)
            (proto,) = made
            slot = bytearray(b"A" * 200_000)
            proto.arena_guard = (_SlotRewrittenAfterCheck(slot), 0, 7)
            proto.write_arena(memoryview(slot))
            got = b""
            for _ in range(100):
                await asyncio.sleep(0.01)
                try:
                    chunk = client.recv(1 << 20)
                except BlockingIOError:
                    if len(got) >= len(slot):
                        break
                    continue
                if not chunk:
                    break
                got += chunk
            return got, proto.arena_cut
        finally:
            client.close()
            server.close()
            await server.wait_closed()

    got, cut = uvloop.run(main()) if hasattr(uvloop, "run") else asyncio.run(main())
    if private:
        assert got == b"A" * 200_000 and not cut  # the copy was taken before the rewrite
    else:
        assert got == b"B" * 200_000  # what open mode risks (its own result's space, one tenant)


def test_a_slot_freed_with_hold_keeps_its_bytes_for_hold_s(arena):
    """ArenaWriter(hold_s): a committed slot freed with hold=True (a front-end may be copying it)
    reads as freed at once (generation 0) but keeps its bytes, and its space is not given out
    again, until hold_s has passed; one freed without hold, or never committed, is reusable at
    once. A front-end that checked the generation just before copying thus never copies another
    result's bytes (GatewayHttpProtocol.write_arena)."""
    w, r = arena
    w.hold_s = 0.3
    shown = w.write(b"\xaa" * 100_000)
    off, gen = shown.offset, shown.generation
    view = r.view(off, 100_000, gen)
    used = w.used_bytes
    w.free(shown, hold=True)
    assert not r.valid(off, gen) and w.held_bytes == shown.capacity and w.used_bytes == used
    again = w.alloc(100_000)  # not in the held space: after it
    assert again is not None and again.offset >= off + shown.capacity
    w.payload(again, 100_000)[:] = b"\xbb" * 100_000
    w.commit(again, 100_000)
    assert bytes(view) == b"\xaa" * 100_000  # the held slot's bytes are untouched
    assert w.release_held() == 0  # not due yet
    time.sleep(0.35)
    assert w.release_held() == 1 and w.held_bytes == 0 and w.used_bytes == used
    third = w.alloc(100_000)  # the held space is given out again now
    assert third is not None and third.offset == off
    # Freed without hold (nobody copying), or never committed (a reservation): no hold.
    w.free(again)
    w.free(third, hold=True)
    assert w.held_bytes == 0 and w.used_bytes == 0 and w.live_slots == 0
    view.release()
