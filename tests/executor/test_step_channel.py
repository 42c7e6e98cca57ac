"""The multi-host step channel on 127.0.0.1: every follower gets each call, in order."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from tests.ports import free_ports
from xlm.executor.step_channel import FollowerChannel, LeaderChannel


def connected_channels() -> tuple[list[FollowerChannel], LeaderChannel]:
    """Two followers and their leader on fresh ports; ports that another process takes
    between choosing and binding them mean a retry on new ones."""
    for _ in range(3):
        port = free_ports(2)  # steps and heartbeats
        # Followers connect first (ZeroMQ reconnects until the leader binds); the
        # leader's constructor returns once both said hello.
        followers = [FollowerChannel("127.0.0.1", port, i, timeout_s=60) for i in (1, 2)]
        try:
            return followers, LeaderChannel("127.0.0.1", port, num_processes=3, timeout_s=60)
        except zmq.ZMQError as e:
            for f in followers:
                f.close()
            if e.errno != zmq.EADDRINUSE:
                raise
    pytest.fail("three tries found their ports taken")


def test_leader_sends_each_call_to_every_follower_in_order():
    followers, leader = connected_channels()
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


def test_a_taken_heartbeat_port_fails_the_leader_instead_of_hanging():
    port = free_ports(2)
    ctx = zmq.Context()
    taken = ctx.socket(zmq.ROUTER)
    taken.bind(f"tcp://127.0.0.1:{port + 1}")
    try:
        with pytest.raises(zmq.ZMQError) as error:
            LeaderChannel("127.0.0.1", port, num_processes=2, timeout_s=5)
        assert error.value.errno == zmq.EADDRINUSE
    finally:
        taken.close(linger=0)
        ctx.term()
