"""The P/D proxy's memory of finished turns, for multi-turn reuse (`--turn-ttl`).

A decode server asked to keep a turn (`kvbroker_keep_turn`) answers with a grant on the turn's KV blocks in its
`kv_transfer_params`. The proxy remembers those params under what the conversation was once that turn ended (the
request's prompt or messages with the answer appended), and hands them to the prefill server of the request that
continues the conversation, whose prompt or messages start with it. Which stored turn a request continues comes only
from what the request says and the credentials it came with, never from a grant or key a client names: turns are kept
per tenant (the `Authorization` header's hash), route and model, so a client can only ever continue a conversation it
could have written itself. The prefill server's connector then checks, token by token (a hash per block), that the
turn's KV is that of its own prompt's first tokens and pulls only those: a match here is a hint, never trusted for
correctness (a template that renders the answer differently costs only the blocks after the difference).

A turn is used once (its grant is released after the pull) and forgotten after `ttl_s` or when `max_turns` newer ones
came, or newer ones' params take its room of `max_bytes`; the decode server frees blocks nobody pulled when its hold
lease lapses.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KEEP_TURN_PARAM = "kvbroker_keep_turn"
"""Set in a decode request's `kv_transfer_params`: grant the finished turn's KV for the next turn (params.py)."""
# The decode output's report of its own pull: not part of the turn's addressing.
_REPORT_KEYS = frozenset({
    "kvbroker_prompt_tokens", "kvbroker_tokens_pulled", "kvbroker_tokens_cached", "kvbroker_tokens_recomputed",
    "kvbroker_refused", "kvbroker_transfer_ms", "kvbroker_transfer_bytes", "kvbroker_backend",
    "kvbroker_history_tokens_pulled",
})
LENGTHS_PER_SCOPE = 16
"""Conversation lengths tried per tenant, route and model when a request arrives (the most recent ones)."""


@dataclass
class _Turn:
    params: dict[str, Any]
    expires: float  # time.monotonic()
    nbytes: int
    """The params' size as JSON (a turn of 5,000 blocks: ~210 KB, ~0.6 MiB held)."""


Conversation = str | tuple[int, ...] | tuple[str, ...]
"""A completion's text prompt, its token ids, or a chat's messages (each as canonical JSON)."""


def conversation_of(path: str, body: Mapping[str, Any]) -> Conversation | None:
    """What the request says the conversation is so far, or None where it is not one this proxy follows."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return None
        return tuple(_message(m) for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    return None


def _message(message: Mapping[str, Any]) -> str:
    # Only what a chat template renders: an answer sent back with extra null fields is the same message.
    kept = {k: message[k] for k in ("role", "content", "name") if message.get(k) is not None}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"))


def answered(conversation: Conversation, path: str, answer: Mapping[str, Any]) -> Conversation:
    """The conversation once the answer is added (as far as the answer says it: a token-id prompt's answer without
    `token_ids` adds nothing, which still lets the next turn reuse the prompt's blocks)."""
    added = added_by(conversation, path, answer)
    if isinstance(conversation, str):
        return conversation + added if isinstance(added, str) else conversation
    return (*conversation, *added)  # (both token ids, or both messages)


def added_by(conversation: Conversation, path: str, answer: Mapping[str, Any]) -> Conversation:
    """What the answer adds to the conversation (`answered`): text, a reply message or token ids, or nothing."""
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    if isinstance(conversation, str):
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    if path.endswith("/chat/completions"):
        message = choice.get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return (_message({"role": "assistant", "content": message["content"]}),)
        return ()
    tokens = choice.get("token_ids")
    if isinstance(tokens, list) and all(type(t) is int for t in tokens):
        return tuple(tokens)
    return ()


def handed_back(params: Any) -> dict[str, Any] | None:
    """The turn's addressing in a decode answer's `kv_transfer_params` (NixlConnector's shape), or None."""
    if not isinstance(params, dict) or params.get("do_remote_decode") is not True or not params.get("remote_block_ids"):
        return None
    return {k: v for k, v in params.items() if k not in _REPORT_KEYS}


MAX_STREAMED_ANSWER_BYTES = 256 * 1024
"""What a streamed answer may carry (its text and a pending event) for the proxy to remember it; past that it is
relayed as ever and not remembered."""


class StreamedAnswer:
    """A streamed answer as the proxy relays it: its text, gathered from the events as they pass, and the decode
    connector's `kv_transfer_params` from its last event (integrations/vllm/streams.py), shaped as the non-streamed
    answer that `answered` and `handed_back` read. Bounded; anything it cannot read means no turn is remembered."""

    def __init__(self, path: str) -> None:
        self._chat = path.endswith("/chat/completions")
        self._pending = b""
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._size = 0
        self._params: dict[str, Any] | None = None
        self._unreadable = False

    def feed(self, chunk: bytes) -> None:
        if self._unreadable:
            return
        self._pending += chunk
        while (end := self._pending.find(b"\n\n")) >= 0:
            event, self._pending = self._pending[:end], self._pending[end + 2:]
            self._read(event)
        self._size += len(chunk)
        if self._size > MAX_STREAMED_ANSWER_BYTES:
            self._unreadable = True
            self._pending, self._text = b"", []

    def _read(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            data = line.removeprefix(b"data:").strip() if line.startswith(b"data:") else None
            if not data or data == b"[DONE]":
                continue
            try:
                document = json.loads(data)
            except ValueError:
                self._unreadable = True
                return
            if not isinstance(document, dict):
                continue
            if isinstance(params := document.get("kv_transfer_params"), dict):
                self._params = params
            choices = document.get("choices")
            choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
            piece = (choice.get("delta") or {}).get("content") if self._chat else choice.get("text")
            if isinstance(piece, str):
                self._text.append(piece)
            ids = choice.get("token_ids")  # (a completion asked for `return_token_ids`)
            if isinstance(ids, list) and all(type(t) is int for t in ids):
                self._token_ids += ids

    def answer(self) -> dict[str, Any] | None:
        """The answer as a non-streamed one would be, or None if the stream said no turn or could not be read."""
        if self._unreadable or self._params is None:
            return None
        text = "".join(self._text)
        choice: dict[str, Any] = {"message": {"role": "assistant", "content": text}} if self._chat else {"text": text}
        if self._token_ids and not self._chat:
            choice["token_ids"] = self._token_ids
        return {"choices": [choice], "kv_transfer_params": self._params}


class TurnMemory:
    """Runs on the proxy's event loop only (no locks)."""

    def __init__(self, ttl_s: float, max_turns: int, max_bytes: int = 64 << 20) -> None:
        self.ttl_s = ttl_s
        self.max_turns = max_turns
        self.max_bytes = max_bytes
        """Of every remembered turn's params as JSON together: turns of long conversations hold a block id and a hash
        per block, so `max_turns` of them alone let one client's long conversations hold gigabytes."""
        self._turns: OrderedDict[bytes, _Turn] = OrderedDict()
        self._lengths: dict[bytes, deque[int]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._turns)

    def remember(self, tenant: str, path: str, body: Mapping[str, Any], conversation: Conversation,
                 params: dict[str, Any]) -> None:
        scope = scope_of(tenant, path, body)
        key = prefix_keys(scope, conversation, (len(conversation),))[len(conversation)]
        self.remember_key(scope, len(conversation), key, params)

    def remember_key(self, scope: bytes, length: int, key: bytes, params: dict[str, Any]) -> None:
        """`remember` of a conversation of `length` whose key (`prefix_keys`, `Running.extended`) is `key`."""
        nbytes = len(json.dumps(params))
        if nbytes > self.max_bytes:
            return
        lengths = self._lengths.setdefault(scope, deque(maxlen=LENGTHS_PER_SCOPE))
        if length in lengths:
            lengths.remove(length)
        lengths.append(length)
        self._forget(self._turns.pop(key, None))
        self._turns[key] = _Turn(params, time.monotonic() + self.ttl_s, nbytes)
        self._bytes += nbytes
        while len(self._turns) > self.max_turns or self._bytes > self.max_bytes:
            self._forget(self._turns.popitem(last=False)[1])
        if len(self._lengths) > self.max_turns:  # scopes of tenants long gone
            self._lengths.pop(next(iter(self._lengths)))

    def take(self, tenant: str, path: str, body: Mapping[str, Any], conversation: Conversation
             ) -> dict[str, Any] | None:
        """The params of the longest remembered turn this conversation continues (forgotten: a grant serves one
        pull), or None."""
        scope = scope_of(tenant, path, body)
        return self.take_keys(prefix_keys(scope, conversation, self.lengths(scope, len(conversation))))

    def lengths(self, scope: bytes, below: int) -> list[int]:
        """The conversation lengths remembered in `scope` (`scope_of`) that a conversation of `below` characters,
        tokens or messages may continue: the prefixes `take_keys` looks for."""
        return [n for n in self._lengths.get(scope, ()) if n < below]

    def take_keys(self, keys: Mapping[int, bytes]) -> dict[str, Any] | None:
        """`take` of a conversation whose prefixes' keys (`prefix_keys`) are `keys`."""
        now = time.monotonic()
        for length in sorted(keys, reverse=True):
            turn = self._turns.pop(keys[length], None)
            self._forget(turn)
            if turn is not None and turn.expires > now:
                return turn.params
        return None

    def _forget(self, turn: _Turn | None) -> None:
        if turn is not None:
            self._bytes -= turn.nbytes


def scope_of(tenant: str, path: str, body: Mapping[str, Any]) -> bytes:
    model = body.get("model")
    return hashlib.sha256(json.dumps([tenant, path, model if isinstance(model, str) else None]).encode()).digest()


@dataclass
class Running:
    """The hash of a whole conversation, which the key of the conversation with an answer added continues."""

    state: Any  # hashlib's sha256 object
    length: int

    def extended(self, added: Conversation) -> tuple[int, bytes]:
        """The length and key of the conversation with `added` (`added_by`) after it: only `added` is hashed."""
        state = self.state.copy()
        _feed(state, added)
        return self.length + len(added), state.digest()


def prefix_keys(scope: bytes, conversation: Conversation, lengths: Collection[int]) -> dict[int, bytes]:
    """The key of the conversation's first `length` characters, tokens or messages for each of `lengths` (those past
    its end are left out), in one pass over it: hashing each prefix on its own read a client's
    body once per length remembered in its scope (16 x 30 MiB of chat messages: ~6 s on the proxy's event loop per
    request)."""
    return running_keys(scope, conversation, lengths)[0]


def running_keys(scope: bytes, conversation: Conversation, lengths: Collection[int]
                 ) -> tuple[dict[int, bytes], Running]:
    """`prefix_keys`, and the whole conversation's hash to continue (`Running.extended`)."""
    h = hashlib.sha256(scope)
    h.update(b"s" if isinstance(conversation, str) else b"l")
    keys: dict[int, bytes] = {}
    done = 0
    for length in sorted({n for n in lengths if 0 <= n <= len(conversation)}):
        _feed(h, conversation[done:length])
        done = length
        keys[length] = h.copy().digest()
    _feed(h, conversation[done:])
    return keys, Running(h, len(conversation))


def _feed(h: Any, part: Conversation) -> None:
    if isinstance(part, str):
        h.update(part.encode("utf-8", "surrogatepass"))
    else:  # (a token id, or a message's canonical JSON, which is ASCII without a raw newline)
        h.update(b"".join(str(item).encode() + b"\n" for item in part))


def tenant_of(headers: Mapping[str, str], names: Sequence[str]) -> str:
    """Whose conversation it is: a hash of the credentials the request carries (none: everyone's the same tenant,
    which only lets a client continue a conversation whose every word it sends)."""
    return hashlib.sha256(json.dumps([headers.get(n, "") for n in names]).encode()).hexdigest()
