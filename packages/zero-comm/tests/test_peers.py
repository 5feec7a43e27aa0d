"""What a surviving rank can say of its peers on its own host (zero_comm.peers)."""

from __future__ import annotations

import signal
import subprocess
import sys

from zero_comm.peers import Peer, describe_dead, this_peer


def test_a_stopped_peer_is_named_as_stopped_and_a_dead_one_as_dead() -> None:
    """A peer stopped by SIGSTOP answers no collective, though it is alive: the timeout's
    message said "Every rank on this host is still running" and named no one (a probe's
    kill -STOP of rank 1). Then it is continued, and then it dies."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    peers = [this_peer(), Peer(this_peer().host, child.pid)]
    try:
        assert describe_dead(peers, 0, settle_s=0) == " Every rank on this host is still running."
        child.send_signal(signal.SIGSTOP)
        wait_for_state(child.pid, "T")
        said = describe_dead(peers, 0, settle_s=0)
        assert (
            said
            == f" rank 1 (pid {child.pid}) is stopped (SIGSTOP or Ctrl-Z: kill -CONT to go on)."
        )
        child.send_signal(signal.SIGCONT)
        wait_for_state(child.pid, "S")
        assert "stopped" not in describe_dead(peers, 0, settle_s=0)
    finally:
        child.kill()
        child.wait()
    assert describe_dead(peers, 0, settle_s=0) == f" rank 1 (pid {child.pid}) is dead."


def wait_for_state(pid: int, state: str) -> None:
    import time
    from pathlib import Path

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == state:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not reach state {state}")
