"""Shared pieces of the rewards tests: the tiny tokenizer, its chat format, a scripted model."""

from __future__ import annotations

import os

import pytest

from rewards.chat import HFChatFormat
from rewards.episode import Generation

# The SDK checks PyPI for a newer version in a thread; this machine has no network for that.
os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")


@pytest.fixture(scope="session")
def tokenizer():
    from rollout_server.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def chat(tokenizer):
    return HFChatFormat(tokenizer)


class ScriptedModel:
    """A ``GenerateFn`` that replays scripted assistant turns.

    The episode is recognised by a key that appears in its prompt, the turn by the number of
    assistant generation prompts so far, so concurrent episodes need no shared state. Each turn
    samples the reply's tokens plus ``<|im_end|>``, with distinct log-probs so tests can check
    where they land."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]], end_turn: bool = True) -> None:
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.end_turn = end_turn
        self.calls: list[list[int]] = []

    async def __call__(self, ids: list[int]) -> Generation:
        self.calls.append(list(ids))
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        key = next(k for k in self.scripts if k in text)
        turn = text.count("<|im_start|>assistant") - 1
        reply = self.scripts[key][turn]
        out = self.tokenizer.encode(reply, add_special_tokens=False)
        if self.end_turn:
            out.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        logprobs = [-(i + 1) / 1000 for i in range(len(out))]
        return Generation(token_ids=out, logprobs=logprobs, text=reply, finish_reason="stop")


@pytest.fixture
def scripted(tokenizer):
    return lambda scripts, **kw: ScriptedModel(tokenizer, scripts, **kw)
