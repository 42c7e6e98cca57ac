"""KV cache events over ZeroMQ, read by a SUB socket as a router would: the publisher's
frames (topic, sequence, msgpack batch), and a real engine's BlockStored events for a
prompt's full blocks (hashes recomputed here) and AllBlocksCleared on a prefix-cache reset."""

from __future__ import annotations

import zmq

from tests.engine.reference import TINY_ENGINE
from tests.ports import free_ports
from xlm.config import KVEventsConfig
from xlm.core.kv_cache_utils import hash_block_tokens
from xlm.core.kv_events import BlockRemoved, decode_event_batch
from xlm.engine.kv_events_publisher import ZmqEventPublisher, make_kv_event_publisher


def subscriber(endpoint: str, topic: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sock.setsockopt(zmq.RCVTIMEO, 200)
    sock.connect(endpoint)
    return sock


def receive_all(sock: zmq.Socket) -> list[list]:
    """Every frame triple waiting on the socket."""
    got = []
    while True:
        try:
            got.append(sock.recv_multipart())
        except zmq.Again:
            return got


def test_publisher_sends_topic_sequence_and_batch():
    endpoint = f"tcp://127.0.0.1:{free_ports(1)}"
    pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", endpoint, "kv"))
    sub = subscriber(endpoint, "kv")
    try:
        frames = []
        for _ in range(50):  # until the subscription reached the publisher
            pub.publish([BlockRemoved([b"h"])])
            frames = receive_all(sub)
            if frames:
                break
        assert frames, "no batch arrived"
        topic, seq, payload = frames[-1]
        assert topic == b"kv" and len(seq) == 8
        _, events, rank = decode_event_batch(payload)
        assert events == [["BlockRemoved", [b"h"], None]] and rank == 0
        pub.publish([])  # nothing to send: no frame, no sequence number used
        pub.publish([BlockRemoved([b"g"])])
        (nxt,) = receive_all(sub)
        assert int.from_bytes(nxt[1], "big") == int.from_bytes(seq, "big") + 1
    finally:
        sub.close()
        pub.shutdown()


def test_disabled_config_has_no_publisher():
    assert make_kv_event_publisher(None) is None
    assert make_kv_event_publisher(KVEventsConfig(enable_kv_cache_events=False)) is None


def test_engine_publishes_a_prompts_blocks(tiny_checkpoint):
    import xlm

    endpoint = f"tcp://127.0.0.1:{free_ports(1)}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    llm = xlm.LLM(model=tiny_checkpoint("llama"), kv_events_config=config, **TINY_ENGINE)
    sub = subscriber(endpoint, "")
    sp = xlm.SamplingParams(max_tokens=1, temperature=0.0)
    try:
        for i in range(50):  # until the subscription reached the publisher
            llm.generate({"prompt_token_ids": [7 + i] * 17}, sp, use_tqdm=False)
            if receive_all(sub):
                break
        prompt = list(range(10, 43))  # two full blocks of 16 and one token
        llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)
        events = [e for f in receive_all(sub) for e in decode_event_batch(f[2])[1]]
        stored = [e for e in events if e[0] == "BlockStored"]
        assert len(stored) == 1
        _, hashes, parent, tokens, block_size, lora_id, _, _ = stored[0]
        first = hash_block_tokens(None, prompt[:16])
        assert hashes == [first, hash_block_tokens(first, prompt[16:32])]
        assert parent is None and tokens == prompt[:32] and block_size == 16 and lora_id is None
        assert llm.reset_prefix_cache()
        events = [e for f in receive_all(sub) for e in decode_event_batch(f[2])[1]]
        assert events == [["AllBlocksCleared"]]
    finally:
        sub.close()
        llm.llm_engine.shutdown()
