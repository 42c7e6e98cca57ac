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
