"""bench.placement pins every thread of the bench process and of the servers, and restores them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from bench.placement import pinned

CORES = sorted(os.sched_getaffinity(0))


def _threads(pid: int) -> list[int]:
    return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(len(CORES) < 2, reason="needs two usable cores")
def test_cross_pins_clients_and_servers_apart_and_restores_them() -> None:
    # A server with a second thread: sched_setaffinity on its pid alone would miss that thread.
    script = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start()"
    server = subprocess.Popen([sys.executable, "-c", script + "; time.sleep(60)"])
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)
    helper.start()
    try:
        deadline = time.monotonic() + 30
        while len(_threads(server.pid)) < 2:
            assert server.poll() is None and time.monotonic() < deadline, "no second thread"
            time.sleep(0.01)
        before = os.sched_getaffinity(0)
        with pinned([server.pid], "cross") as where:
            assert where == f"client on core {CORES[0]}, servers on core {CORES[1]}"
            for tid in _threads(os.getpid()):
                assert os.sched_getaffinity(tid) == {CORES[0]}
            for tid in _threads(server.pid):
                assert os.sched_getaffinity(tid) == {CORES[1]}
            late = threading.Thread(target=stop.wait)
            late.start()  # started while pinned: inherits the pin, and is restored too
        for tid in _threads(os.getpid()):
            assert os.sched_getaffinity(tid) == before
        for tid in _threads(server.pid):
            assert os.sched_getaffinity(tid) == before
    finally:
        stop.set()
        helper.join()
        server.kill()
        server.wait()


def test_same_pins_everything_to_one_core() -> None:
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pinned([server.pid], "same") as where:
            assert where == f"client and server on core {CORES[0]}"
            assert os.sched_getaffinity(0) == {CORES[0]} == os.sched_getaffinity(server.pid)
        assert os.sched_getaffinity(0) == set(CORES)
    finally:
        server.kill()
        server.wait()
