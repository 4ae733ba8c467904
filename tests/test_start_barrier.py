"""The API servers of --api-server-count start accepting together (server/start_barrier.py): real processes on the
barrier's pipes, one of them ready a second after the other."""

import subprocess
import sys
import time

from jax_engine.server.start_barrier import StartBarrier

API_SERVER = """
import sys, time
from jax_engine.server.start_barrier import wait_for_the_others
time.sleep(float(sys.argv[1]))  # its imports and its engine
ready = time.monotonic()
wait_for_the_others((int(sys.argv[2]), int(sys.argv[3])))
print(ready, time.monotonic())
"""


def _api_servers(barrier: StartBarrier, delays: list[float]) -> list[subprocess.Popen]:
    servers = [subprocess.Popen([sys.executable, "-c", API_SERVER, str(delay), *map(str, barrier.child_fds)],
                                stdout=subprocess.PIPE, text=True, pass_fds=barrier.child_fds) for delay in delays]
    return servers


def _supervise(barrier: StartBarrier) -> None:
    """The supervisor's watch loop (api_servers.py), as far as the barrier goes."""
    barrier.started()
    deadline = time.monotonic() + 60
    while not barrier.released and time.monotonic() < deadline:
        barrier.wait(0.05)


def test_each_api_server_waits_until_all_are_ready():
    barrier = StartBarrier(2)
    servers = _api_servers(barrier, [0.0, 1.0])
    _supervise(barrier)
    assert barrier.ready == 2
    (ready_early, go_early), (ready_late, go_late) = (map(float, s.communicate(timeout=60)[0].split()) for s in servers)
    barrier.close()
    assert ready_late - ready_early > 0.5  # the second was ready later...
    assert go_early >= ready_late and go_late >= ready_late  # ...and neither went on before it was
    assert abs(go_early - go_late) < 0.5


def test_an_api_server_gone_before_it_was_ready_releases_the_others():
    """The supervisor stops everything when one dies; until then the others are not held forever either."""
    barrier = StartBarrier(2)
    servers = _api_servers(barrier, [0.0])
    dead = subprocess.Popen([sys.executable, "-c", "pass"], pass_fds=barrier.child_fds)  # exits, never ready
    dead.wait()
    _supervise(barrier)
    assert barrier.ready == 1 and servers[0].communicate(timeout=60)[0].split()
    barrier.close()
