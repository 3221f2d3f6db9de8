"""streams.py without vLLM: a wrapped stream generator sends one event with the last output's kv_transfer_params just
before [DONE], changes nothing else, and leaves a stream without them as it was. With real vLLM servers:
tests/vllm/test_openai_proxy_e2e.py (`assert_says_where_its_kv_came_from`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from types import SimpleNamespace
from typing import Any

from kvbroker.integrations.vllm.streams import _wrap

closed: list[str] = []


class FakeServing:
    """The shape of vLLM's completion stream generator: outputs in, SSE chunks out, [DONE] last."""

    async def completion_stream_generator(self, request: Any, engine_inputs: Any,
                                          result_generator: AsyncIterator[tuple[int, Any]], request_id: str,
                                          created_time: int, model_name: str, *, num_prompts: int = 1
                                          ) -> AsyncGenerator[str, None]:
        try:
            async for _, output in result_generator:
                yield f"data: {json.dumps({'id': request_id, 'choices': [{'text': output.text}]})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            closed.append(request_id)


async def _outputs(params: list[dict[str, Any] | None]) -> AsyncGenerator[tuple[int, Any], None]:
    for i, p in enumerate(params):
        yield 0, SimpleNamespace(text=f"t{i}", kv_transfer_params=p)


async def _stream(params: list[dict[str, Any] | None], take: int | None = None) -> list[str]:
    wrapped = _wrap(FakeServing.completion_stream_generator, "text_completion")
    stream = wrapped(FakeServing(), None, [], _outputs(params), "cmpl-1", 0, "tiny", num_prompts=1)
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if take is not None and len(chunks) == take:
            await stream.aclose()
            assert closed == ["cmpl-1"]  # at once, not when the loop finalises leftover generators
            break
    return chunks


def test_the_last_outputs_kv_transfer_params_go_out_just_before_done() -> None:
    pulled = {"kvbroker_tokens_pulled": 64, "kvbroker_transfer_bytes": 4096}
    chunks = asyncio.run(_stream([None, None, pulled]))
    assert len(chunks) == 5 and chunks[-1] == "data: [DONE]\n\n"
    event = json.loads(chunks[-2].removeprefix("data: "))
    assert event["kv_transfer_params"] == pulled
    assert event["choices"] == [] and event["id"] == "cmpl-1" and event["model"] == "tiny"
    assert event["object"] == "text_completion"
    assert [json.loads(c.removeprefix("data: "))["choices"][0]["text"] for c in chunks[:3]] == ["t0", "t1", "t2"]


def test_a_stream_without_kv_transfer_params_is_left_as_it_was() -> None:
    chunks = asyncio.run(_stream([None, None]))
    assert len(chunks) == 3 and chunks[-1] == "data: [DONE]\n\n"
    assert all("kv_transfer_params" not in c for c in chunks)


def test_a_client_that_goes_away_closes_vllms_generator_too() -> None:
    closed.clear()
    assert len(asyncio.run(_stream([None, None, None], take=1))) == 1
