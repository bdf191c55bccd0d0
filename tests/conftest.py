"""Shared fixtures: a real gateway on loopback (S=2, F=2, embedded simulator) and expected values."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from shardserver.testing import RunningServer, http_json, leftovers_of_started_servers

BASE_MODEL = "Qwen/Qwen3-8B"


class _HeartbeatOfEndedGateways(logging.Filter):
    """Drops the SDK's "Session heartbeat failed" warnings: the ServiceClients of finished tests
    keep heartbeating to gateways that those tests stopped (tinker before 0.38 has no close()),
    and after 2 minutes every one of them warned on stderr at the end of the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Session heartbeat failed")


logging.getLogger("tinker.lib.internal_client_holder").addFilter(_HeartbeatOfEndedGateways())


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite: no process and no /dev/shm segment of any server the tests started."""
    yield
    procs, segs = leftovers_of_started_servers()
    assert not segs, f"shared-memory segments left behind: {segs}"
    assert not procs, f"processes left behind: {procs}"


@pytest.fixture(scope="session", autouse=True)
def state_dir_of_the_tests(tmp_path_factory):
    """Servers the tests start keep their ID secret (``server.state_dir`` defaults to
    ``$XDG_STATE_HOME/shardserver``) in a temporary directory, not in the user's home."""
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("xdg-state"))
    yield
    if old is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = old


@pytest.fixture(scope="module")
def server():
    """One gateway for a test module: 2 encoders, 2 front-ends, embedded simulator."""
    with RunningServer(env={"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "2",
                            "SHARDSERVER_SHARDS__ARENA_BYTES": str(64 * 1024 * 1024)}) as s:
        yield s
    assert s.proc is not None and s.proc.returncode == 0, "\n".join(s.log_lines[-30:])
    assert not s.leftover_processes


def engine_body(prompt: list[int], n: int, max_tokens: int, seed: int | None, *, temperature: float = 1.0,
                prompt_logprobs: int | None = None, stop: list | None = None, sim: dict | None = None) -> dict:
    """What the embedded simulator sends for the engine request the gateway builds (parsed JSON)."""
    from shardserver.engine_sim import SimConfig, render_completion

    req = {"model": BASE_MODEL, "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": temperature,
           "top_p": 1.0, "top_k": -1, "logprobs": 1, "return_token_ids": True}
    if seed is not None:
        req["seed"] = seed
    if prompt_logprobs is not None:
        req["prompt_logprobs"] = prompt_logprobs
    if stop:
        req["stop_token_ids" if isinstance(stop[0], int) else "stop"] = stop
    return json.loads(render_completion(req, SimConfig.from_mapping(sim or {"model_name": BASE_MODEL})))


def expected_sequences(body: dict) -> list[dict]:
    """Per choice: tokens (list[int]), logprobs (float32 array), stop_reason as the SDK reports it."""
    out = []
    for ch in sorted(body["choices"], key=lambda c: c["index"]):
        out.append({"tokens": ch["token_ids"],
                    "logprobs": np.asarray(ch["logprobs"]["token_logprobs"], dtype=np.float32),
                    "stop_reason": "length" if ch["finish_reason"] == "length" else "stop"})
    return out


def expected_prompt_logprobs(body: dict, prompt: list[int], k: int):
    """(prompt_logprobs with None at undefined positions, top-k rows as [(id, float32 lp)] or None)."""
    plp = body["choices"][0]["prompt_logprobs"]
    lps: list = []
    topk: list = []
    for i, pos in enumerate(plp):
        if pos is None:
            lps.append(None)
            topk.append(None)
            continue
        lps.append(float(np.float32(pos[str(prompt[i])]["logprob"])))
        entries = sorted(((int(t), v["logprob"]) for t, v in pos.items()), key=lambda e: -e[1])[:k]
        topk.append([(t, float(np.float32(lp))) for t, lp in entries])
    return lps, topk


class Api:
    """Raw HTTP calls against a running gateway (the SDK's wire protocol by hand)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def post(self, path: str, body, headers: dict | None = None, timeout: float = 40.0):
        return http_json(self.url + path, body, headers=headers, timeout=timeout)

    def sampling_session(self) -> str:
        st, _, b = self.post("/api/v1/create_session", {"tags": [], "user_metadata": {}})
        assert st == 200, b
        st, _, b = self.post("/api/v1/create_sampling_session",
                             {"session_id": json.loads(b)["session_id"], "base_model": BASE_MODEL})
        assert st == 200, b
        return json.loads(b)["sampling_session_id"]

    def submit(self, ssid: str, tokens: list[int], seq_id: int = 0, max_tokens: int = 4, seed: int = 1) -> str:
        """asample one sample; returns its request_id (asserts 200)."""
        st, _, b = self.post("/api/v1/asample", {
            "sampling_session_id": ssid, "seq_id": seq_id, "num_samples": 1,
            "prompt": {"chunks": [{"tokens": tokens}]},
            "sampling_params": {"max_tokens": max_tokens, "seed": seed}})
        assert st == 200, b
        return json.loads(b)["request_id"]


@pytest.fixture(scope="module")
def api(server) -> Api:
    return Api(server.url)


def old_sdk_python(venv: str) -> str | None:
    """The python of an old-SDK virtualenv that `make test` builds (``.venv-sdk024``, ``.venv-sdk015``).

    Missing is a failure under `make test` (SHARDSERVER_OLD_SDKS_REQUIRED=1), a skip otherwise.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    py = os.path.join(root, venv, "bin", "python")
    if os.path.exists(py):
        return py
    assert not os.environ.get("SHARDSERVER_OLD_SDKS_REQUIRED"), f"{py} is missing (make test builds it)"
    return None
