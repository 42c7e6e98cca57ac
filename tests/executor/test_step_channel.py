"""The multi-host step channel on 127.0.0.1: every follower gets each call, in order."""

from __future__ import annotations

import socket

import numpy as np

from xlm.executor.step_channel import FollowerChannel, LeaderChannel


def free_port_pair() -> int:
    """A port p with p and p + 1 free (steps and heartbeats)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


def test_leader_sends_each_call_to_every_follower_in_order():
    port = free_port_pair()
    # Followers connect first (ZeroMQ reconnects until the leader binds); the leader's
    # constructor returns once both said hello.
    followers = [FollowerChannel("127.0.0.1", port, i, timeout_s=60) for i in (1, 2)]
    leader = LeaderChannel("127.0.0.1", port, num_processes=3, timeout_s=60)
    try:
        assert sorted(leader.followers) == [1, 2]
        calls = [("dispatch", {"step": i, "ids": np.arange(i + 3)}) for i in range(3)]
        for call in calls:
            leader.send(call)
        for f in followers:
            for name, payload in calls:
                got_name, got = f.recv()
                assert got_name == name and got["step"] == payload["step"]
                np.testing.assert_array_equal(got["ids"], payload["ids"])
    finally:
        for f in followers:
            f.close()
        leader.close()
