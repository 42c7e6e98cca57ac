"""KVEventsConfig from --kv-events-config's JSON (vLLM's shape), its errors, and the host
KV tier's size in CacheConfig; both flags exist on the engine CLI."""

import argparse

import pytest

from xlm.config import CacheConfig, KVEventsConfig
from xlm.engine.arg_utils import EngineArgs


def test_from_json_in_vllms_shape():
    text = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://127.0.0.1:5557", "topic": "kv"}'
    )
    config = KVEventsConfig.from_dict(text)
    assert config == KVEventsConfig(True, "zmq", "tcp://127.0.0.1:5557", "kv")
    assert config.publishes
    assert KVEventsConfig.from_dict(None) is None
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not JSON"),
        ("[1]", "must be a JSON object"),
        ({"enable": True}, "unknown keys ['enable']"),
        ({"publisher": "kafka"}, "KVEventsConfig.publisher='kafka' is invalid"),
        ({"endpoint": "localhost"}, "KVEventsConfig.endpoint='localhost' is invalid"),
    ],
)
def test_bad_configs_name_the_key(value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        KVEventsConfig.from_dict(value)


def test_kv_offloading_size_is_checked():
    assert CacheConfig().kv_offloading_size == 0  # off by default
    with pytest.raises(ValueError, match="kv_offloading_size=-1 is invalid"):
        CacheConfig(kv_offloading_size=-1)


def test_engine_flags():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(
        ["--kv-offloading-size", "2.5", "--kv-events-config", '{"enable_kv_cache_events": true}']
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.kv_offloading_size == 2.5
    assert KVEventsConfig.from_dict(engine_args.kv_events_config).enable_kv_cache_events


def test_each_data_parallel_rank_gets_its_own_endpoint():
    tcp = KVEventsConfig(True, "zmq", "tcp://*:5557", "kv")
    assert tcp.for_rank(0) is tcp
    assert [tcp.for_rank(r).endpoint for r in (1, 3)] == ["tcp://*:5558", "tcp://*:5560"]
    assert tcp.for_rank(2).topic == "kv" and tcp.for_rank(2).connect_endpoint == (
        "tcp://127.0.0.1:5559"
    )
    assert KVEventsConfig(True, endpoint="tcp://10.0.0.2:7000").connect_endpoint == (
        "tcp://10.0.0.2:7000"
    )
    ipc = KVEventsConfig(True, endpoint="ipc:///tmp/ev")
    assert [ipc.for_rank(r).endpoint for r in (0, 1)] == ["ipc:///tmp/ev", "ipc:///tmp/ev-dp1"]
    assert ipc.for_rank(1).connect_endpoint == "ipc:///tmp/ev-dp1"
