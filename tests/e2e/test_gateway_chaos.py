"""The gateway itself under fire while the real SDK keeps sampling: SDK 0.38 waits on the
session-wide poller (the default), one ServiceClient for the whole run (as an RL loop keeps its
own), and between rounds of samples the gateway is SIGKILLed and started again 10 ms later, one
encoder is SIGKILLed (the supervisor respawns it), the gateway is stopped with SIGTERM and
started again, and one front-end is SIGKILLed. Every sample must complete with the simulator's
exact tokens and logprobs, no error may reach the caller, and none may be left waiting.

:func:`gateway_chaos` is also the body of ``benchmarks/gateway_chaos.py`` (more rounds, more
samples in flight)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from typing import Any, Callable

import numpy as np
import pytest

from conftest import BASE_MODEL, engine_body, expected_sequences
from shardserver.testing import REPO, RunningServer, free_port, http_json, metric_sum

__all__ = ["FAULTS", "gateway_chaos"]

#: The faults, injected in this order (round r gets ``FAULTS[r % 4]`` unless a list is given).
FAULTS = ("kill_gateway", "kill_encoder", "term_gateway", "kill_front_end")

API_KEY = "tml-gateway-chaos-key-0123456789"


def _child(supervisor: int, role: str) -> int | None:
    """The pid of the live child of ``supervisor`` titled ``shardserver: <role>`` (e.g.
    ``encoder 0``), from /proc; None when there is none."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace").strip()
        except OSError:
            continue
        if int(fields[1]) == supervisor and fields[0] != "Z" and title == f"shardserver: {role}":
            return int(d)
    return None


def _wrong(resp: Any, i: int) -> bool:
    """Whether a sample of prompt ``[900, i]`` (seed ``i``, 12 tokens) differs from the simulator's answer."""
    want = expected_sequences(engine_body([900, i], 1, 12, i))
    if [list(s.tokens) for s in resp.sequences] != [w["tokens"] for w in want]:
        return True
    return not all(np.array_equal(np.asarray(s.logprobs, dtype=np.float32), w["logprobs"])
                   for s, w in zip(resp.sequences, want))


def gateway_chaos(*, rounds: int, in_flight: int, per_round: int, env: dict[str, str], config: str = "demo",
                  faults: tuple[str, ...] = FAULTS, sample_timeout_s: float = 90.0,
                  log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Sample through one gateway while faults hit it; returns the tally.

    Args:
        rounds: faults injected, ``faults[r % len(faults)]`` in round ``r``.
        in_flight: samples kept in flight (SDK futures).
        per_round: samples completed between two faults.
        env: the gateway's environment (its state directory must survive restarts: the ID
            secret and the futures journals live there).
        config: ``configs/<config>.toml``.
        faults: names from :data:`FAULTS`.
        sample_timeout_s: after the last fault, how long the samples still in flight may take
            (seconds) before they count as ``hung``.
        log: progress lines.

    Returns:
        ``{"completed", "errors" (list of str), "wrong" (sample indexes), "hung" (sample indexes),
        "faults" (names injected), "restored_lost", "rejected_stopping", "resubmitted_410",
        "seconds"}``; the counters are summed over the gateway runs, scraped before each stop.
    """
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    t0 = time.monotonic()
    port = free_port()
    cfg_path = REPO / "configs" / f"{config}.toml"
    servers = [RunningServer(config=cfg_path, env=env, args=["--port", str(port)]).__enter__()]
    tally = {"restored_lost": 0.0, "rejected_stopping": 0.0, "resubmitted_410": 0.0}

    def scrape() -> None:
        try:
            m = http_json(f"http://127.0.0.1:{port}/metrics", timeout=5)[2].decode()
        except OSError:
            return
        tally["restored_lost"] += metric_sum(m, "shardserver_encoder_events_total", event="restored_lost")
        tally["rejected_stopping"] += metric_sum(m, "shardserver_encoder_events_total", event="rejected_stopping")
        tally["resubmitted_410"] += metric_sum(m, "shardserver_http_requests_total", code="410",
                                            endpoint="retrieve_future")

    done: dict[int, Any] = {}
    errors: list[str] = []
    wrong: list[int] = []
    injected: list[str] = []
    pending: dict[cf.Future, int] = {}
    try:
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=API_KEY)
        sampler = service.create_sampling_client(base_model=BASE_MODEL).result(60)
        next_i = 0

        def submit() -> None:
            nonlocal next_i
            fut = sampler.sample(prompt=types.ModelInput.from_ints([900, next_i]), num_samples=1,
                                 sampling_params=types.SamplingParams(max_tokens=12, seed=next_i, temperature=1.0))
            pending[fut] = next_i
            next_i += 1

        for _ in range(in_flight):
            submit()
        last_fault_at = len(done)
        deadline = None
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                break
            ready, _ = cf.wait(list(pending), timeout=1.0, return_when=cf.FIRST_COMPLETED)
            for fut in ready:
                i = pending.pop(fut)
                try:
                    resp = fut.result()
                except BaseException as exc:  # noqa: BLE001 - every error that reaches the caller counts
                    errors.append(f"sample {i}: {type(exc).__name__}: {exc}"[:300])
                    continue
                done[i] = resp
                if _wrong(resp, i):
                    wrong.append(i)
                if deadline is None:
                    submit()
            if deadline is None and len(done) - last_fault_at >= per_round:
                fault = faults[len(injected) % len(faults)]
                srv = servers[-1]
                log(f"{time.monotonic() - t0:6.1f} s: {fault} ({len(done)} done, {len(pending)} in flight)")
                scrape()
                if fault in ("kill_gateway", "term_gateway"):
                    if fault == "kill_gateway":
                        os.kill(srv.proc.pid, signal.SIGKILL)
                        srv.proc.wait(10)
                        time.sleep(0.01)
                    else:
                        assert srv.stop() == 0, "the gateway did not stop cleanly on SIGTERM"
                    servers.append(RunningServer(config=cfg_path, env=env, args=["--port", str(port)]).__enter__())
                else:
                    role = "encoder 0" if fault == "kill_encoder" else "front-end 0"
                    pid = _child(srv.proc.pid, role)
                    assert pid is not None, f"no {role} under the supervisor {srv.proc.pid}"
                    os.kill(pid, signal.SIGKILL)
                injected.append(fault)
                last_fault_at = len(done)
                if len(injected) == rounds:
                    deadline = time.monotonic() + sample_timeout_s  # stop submitting; drain
        scrape()
    finally:
        for s in servers:
            s.stop()
    return {"completed": len(done), "errors": errors, "wrong": wrong, "hung": sorted(pending.values()),
            "faults": injected, **{k: int(v) for k, v in tally.items()}, "seconds": round(time.monotonic() - t0, 1),
            "leftover_processes": any(s.leftover_processes for s in servers)}


@pytest.mark.sdk
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sdk_rides_out_gateway_kills_restarts_and_worker_deaths(tmp_path):
    """Four rounds (one of each fault) with 32 samples in flight, 24 completed between faults:
    every sample completes exactly and none errs or hangs; the restarts' lost futures were
    reported through the poller (``restored_lost`` > 0) and resubmitted after a 410."""
    env = {"SHARDSERVER_SERVER__STATE_DIR": str(tmp_path / "state"), "SHARDSERVER_SHARDS__COUNT": "2",
           "SHARDSERVER_SERVER__FRONT_ENDS": "2", "SHARDSERVER_SHARDS__ARENA_BYTES": str(16 * 1024 * 1024),
           "SHARDSERVER_SERVER__GRACEFUL_SHUTDOWN_S": "1", "SHARDSERVER_SIMULATOR__LATENCY_S": "0.2"}
    out = gateway_chaos(rounds=4, in_flight=32, per_round=24, env=env, sample_timeout_s=60)
    assert out["faults"] == list(FAULTS)
    assert (out["errors"], out["wrong"], out["hung"]) == ([], [], [])
    assert out["completed"] >= 4 * 24 + 32
    assert out["restored_lost"] > 0 and out["resubmitted_410"] > 0
    assert not out["leftover_processes"]
