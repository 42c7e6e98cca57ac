"""AsyncLLM over a real engine process running a stand-in core, with the real processors."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.engine.fake_core import FakeEngineCoreProc
from xlm.engine.async_llm import AsyncLLM
from xlm.engine.exceptions import EngineDeadError
from xlm.engine.mp_client import AsyncMPClient
from xlm.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.timeout(180)


def _engine(tokenizer, step_sleep: float = 0.0) -> AsyncLLM:
    from xlm.engine.processor import Processor

    client = AsyncMPClient({"step_sleep": step_sleep}, True, FakeEngineCoreProc)
    return AsyncLLM(
        None,
        engine_core_client=client,
        tokenizer=tokenizer,
        processor=Processor(tokenizer, max_model_len=128),
    )


def test_generate_delta_cumulative_n_and_cancel(tokenizer):
    async def main() -> None:
        engine = _engine(tokenizer, step_sleep=0.002)
        try:
            prompt = {"prompt_token_ids": [1000, 1001]}
            delta = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.DELTA)
            outs = [o async for o in engine.generate(prompt, delta, "d")]
            ids = [t for o in outs for t in o.outputs[0].token_ids]
            assert ids == [1002, 1003, 1004, 1005, 1006]
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
            assert "".join(o.outputs[0].text for o in outs) == tokenizer.decode(ids)

            cumulative = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.CUMULATIVE)
            outs = [o async for o in engine.generate(prompt, cumulative, "c")]
            assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]

            many = SamplingParams(n=3, max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)
            outs = [o async for o in engine.generate(prompt, many, "n")]
            assert len(outs) == 1 and outs[0].request_id == "n"
            assert sorted(c.index for c in outs[0].outputs) == [0, 1, 2]

            # Cancelling the consumer aborts the request in the core.
            endless = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA)

            async def consume() -> None:
                async for _ in engine.generate(prompt, endless, "x"):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for _ in range(100):
                if await engine.engine_core.call_utility_async("num_requests") == 0:
                    break
                await asyncio.sleep(0.02)
            assert await engine.engine_core.call_utility_async("num_requests") == 0
            assert engine.num_unfinished_requests == 0
            assert not engine.output_processor.has_unfinished_requests()
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_many_concurrent_requests_and_engine_death(tokenizer):
    async def main() -> None:
        engine = _engine(tokenizer, step_sleep=0.002)
        try:
            params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)

            async def one(i: int) -> list[int]:
                prompt = {"prompt_token_ids": [100 + i]}
                return [
                    t
                    async for o in engine.generate(prompt, params, f"r{i}")
                    for t in o.outputs[0].token_ids
                ]

            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(300))), 60)
            assert all(r == [101 + i, 102 + i, 103 + i, 104 + i] for i, r in enumerate(results))

            long = SamplingParams(max_tokens=120, output_kind=RequestOutputKind.DELTA)
            gen = engine.generate({"prompt_token_ids": [5]}, long, "long")
            await gen.__anext__()
            os.kill(engine.engine_core.engine.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async with asyncio.timeout(10):
                    async for _ in gen:
                        pass
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate({"prompt_token_ids": [5]}, params, "late"):
                    pass
        finally:
            engine.shutdown()

    asyncio.run(main())
