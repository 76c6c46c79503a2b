"""Two mmserve servers on loopback behind one SDK client (a list of targets, round robin):
calls reach both, and draining one (SIGTERM's path: health NOT_SERVING, new calls refused
UNAVAILABLE, running ones finish) sends the rest to the other with no failed call."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from mmserve.server.config import ModelSpec
from mmserve_client import Client
from tests.server.conftest import serve


def test_two_servers_behind_one_client_survive_a_drain(tiny_models: dict[str, Path]) -> None:
    spec = [ModelSpec("m", str(tiny_models["tiny-b"]))]
    a, b = serve(spec), serve(spec)
    failures: list[BaseException] = []
    answered: list[int] = []
    done = threading.Event()
    try:
        with Client([a.target, b.target], timeout=30) as c:
            c.wait_ready(10)
            assert c.generate([1, 2, 3], model="m", max_tokens=2, ignore_eos=True).token_ids

            def caller() -> None:
                while not done.is_set():
                    try:
                        r = c.generate([1, 2, 3], model="m", max_tokens=4, ignore_eos=True)
                        answered.append(len(r.token_ids))
                    except BaseException as e:  # noqa: BLE001 - reported by the test
                        failures.append(e)

            threads = [threading.Thread(target=caller) for _ in range(3)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            a.stop()  # drains (grace 2 s), then stops
            before = len(answered)
            time.sleep(0.5)
            done.set()
            for t in threads:
                t.join(30)
        assert failures == []
        assert len(answered) > before  # b kept answering after a was gone
        assert set(answered) == {4}
    finally:
        done.set()
        b.stop()
