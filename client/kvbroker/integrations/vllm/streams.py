"""A streamed answer says where its prompt's KV came from, as a non-streamed one does.

vLLM 0.32 puts the connector's `kv_transfer_params` (the decode side's `kvbroker_tokens_pulled`, `..._recomputed`,
`kvbroker_transfer_bytes`, ...) into a non-streamed answer only: its stream generators drop them. `install` wraps the
OpenAI server's completion and chat stream generators so that, when the request's last output carries
`kv_transfer_params`, one more event goes out just before `data: [DONE]`:

    data: {"id": ..., "object": "text_completion" | "chat.completion.chunk", "created": ..., "model": ...,
           "choices": [], "kv_transfer_params": {...}}

(an event without choices, as vLLM's own usage event is, so OpenAI clients read past it). Nothing else of the stream
changes, and a stream whose outputs carry no `kv_transfer_params` (a server without a connector) is left as it was.
vLLM 0.33 and later also put them on the chunk carrying the finish reason; the event is still sent there, so that the
last event before `[DONE]` means the same on every version.
The P/D proxy relays the decode server's stream as it is, this event included. Installed in the server's front end by
the connector's `build_prom_metrics` hook.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

log = logging.getLogger(__name__)

_DONE = "data: [DONE]\n\n"
_installed = False
_install_lock = threading.Lock()


def _params_of(item: Any) -> dict[str, Any] | None:
    output = item[1] if isinstance(item, tuple) else item  # completions: (prompt index, output); chat: the output
    params = getattr(output, "kv_transfer_params", None)
    return params if isinstance(params, dict) and params else None


def final_event(object_type: str, request_id: str, model_name: str, params: dict[str, Any]) -> str:
    event = {"id": request_id, "object": object_type, "created": int(time.time()), "model": model_name,
             "choices": [], "kv_transfer_params": params}
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


def _wrap(generator: Callable[..., AsyncGenerator[str, None]], object_type: str
          ) -> Callable[..., AsyncGenerator[str, None]]:
    signature = inspect.signature(generator)

    @functools.wraps(generator)
    async def wrapped(*args: Any, **kwargs: Any) -> AsyncGenerator[str, None]:
        bound = signature.bind(*args, **kwargs)
        outputs: AsyncIterator[Any] = bound.arguments["result_generator"]
        seen: list[dict[str, Any]] = []

        async def watched() -> AsyncGenerator[Any, None]:
            async for item in outputs:
                if (params := _params_of(item)) is not None:
                    seen.append(params)
                yield item

        bound.arguments["result_generator"] = watched()
        # Closed with this one (a client that went away), not left to the garbage collector.
        async with contextlib.aclosing(generator(*bound.args, **bound.kwargs)) as chunks:
            async for chunk in chunks:
                if chunk == _DONE and seen:
                    yield final_event(object_type, bound.arguments["request_id"], bound.arguments["model_name"],
                                      seen[-1])
                yield chunk

    return wrapped


def install() -> None:
    """Wraps vLLM's OpenAI stream generators (once per process)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except ImportError as e:  # another vLLM layout: streams go out as vLLM sends them
        log.warning("kvbroker connector: streamed answers will not carry kv_transfer_params (%s)", e)
        return
    for cls, name, object_type in ((OpenAIServingCompletion, "completion_stream_generator", "text_completion"),
                                   (OpenAIServingChat, "chat_completion_stream_generator", "chat.completion.chunk")):
        original = getattr(cls, name)
        parameters = inspect.signature(original).parameters
        if not {"result_generator", "request_id", "model_name"} <= set(parameters):
            log.warning("kvbroker connector: %s.%s has another signature; its streams will not carry "
                        "kv_transfer_params", cls.__name__, name)
            continue
        setattr(cls, name, _wrap(original, object_type))
