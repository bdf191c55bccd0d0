"""Run by ``test_startup_checks.py::test_dev_shm_filled_after_the_start_...`` inside a private
mount namespace whose ``/dev/shm`` is a 64 MiB tmpfs (``unshare -m``): start a gateway with a
32 MiB arena, fill ``/dev/shm`` with another file, sample, free the space, sample again. Prints
one JSON object of what it saw (the test asserts on it). Not a test module itself."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for conftest

from conftest import Api  # noqa: E402
from shardserver.testing import RunningServer  # noqa: E402

FILLER = "/dev/shm/other-program"


def main() -> None:
    # Engine answers take 1 s: two samples are pending (reserved, nothing written) when /dev/shm
    # fills, so the second one's slot header lies on a page tmpfs never backed.
    env = {"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(32 << 20), "SHARDSERVER_SIMULATOR__LATENCY_S": "1.0"}
    seen: dict = {}
    with RunningServer(env=env) as s:
        api = Api(s.url)
        ssid = api.sampling_session()

        def asample(seq: int):
            return api.post("/api/v1/asample", {
                "sampling_session_id": ssid, "seq_id": seq, "num_samples": 4,
                "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 2000, "seed": 1}})

        def retrieve(rid: str):
            for _ in range(100):
                st, h, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
                if st != 408:
                    return st, b
            return 408, b""

        firsts = [asample(i) for i in range(2)]
        seen["first_asample"] = [st for st, _, _ in firsts]
        with open(FILLER, "wb") as f:  # another program fills /dev/shm after the start
            try:
                for _ in range(80):
                    f.write(b"\1" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        seen["first_retrieve"] = []
        for _, _, b in firsts:
            st, b = retrieve(json.loads(b)["request_id"])
            seen["first_retrieve"].append([st, json.loads(b)])
        st, _, b = asample(10)
        seen["while_full"] = [st, json.loads(b)]
        os.unlink(FILLER)  # the space comes back
        st, _, b = asample(11)
        seen["after"] = st
        st, b = retrieve(json.loads(b)["request_id"])
        seen["after_retrieve"] = [st, len(b)]
        time.sleep(0.3)
        seen["lines"] = [ln for ln in s.log_lines if "ERROR" in ln or "SIGBUS" in ln or "exited" in ln
                         or "died" in ln or "Traceback" in ln]
    print("RESULT " + json.dumps(seen))


if __name__ == "__main__":
    main()
