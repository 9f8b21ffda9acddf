"""The check a new weight version passes before it is served: one short fixed greedy
generation whose log-probs must all be finite.

Every update's values are scanned for NaN/inf before they load, but finite weights can still
overflow the forward pass (a norm weight of 3e38): such a version would answer every
generation with an error. The probe runs right after the load, under the pause gate's write
side (no generation sees the weights before it passed), on every transport and both engines
(it is the engine's own ``generate``). What follows a failed probe is the caller's:
``WeightsService`` restores the previous weights where the engine kept a copy, and otherwise
marks the server not ready until an update passes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rollout_server.protocol import SamplingParams

if TYPE_CHECKING:
    from rollout_server.engine.base import Engine

PROBE_PROMPT_LEN = 8
PROBE_TOKENS = 4


def probe_prompt(vocab_size: int, max_model_len: int) -> list[int]:
    """Fixed token ids that fit the vocabulary and leave room for the probe's tokens."""
    length = max(1, min(PROBE_PROMPT_LEN, max_model_len - PROBE_TOKENS))
    return [(7 * i + 1) % vocab_size for i in range(length)]


async def probe_generation(engine: Engine) -> str | None:
    """None when the probe's log-probs are all finite, else what went wrong (one sentence)."""
    info = engine.info()
    prompt = probe_prompt(info.vocab_size, info.max_model_len)
    params = SamplingParams(temperature=0, max_tokens=PROBE_TOKENS, ignore_eos=True, seed=0)
    try:
        ((sample,),) = await engine.generate([prompt], 1, params)
    except Exception as exc:  # an engine that cannot generate with these weights
        return f"a {PROBE_TOKENS}-token greedy probe generation failed: {type(exc).__name__}: {exc}"
    if not math.isfinite(sum(sample.logprobs)):
        return (
            f"a {PROBE_TOKENS}-token greedy probe generation gives non-finite log-probs "
            f"({', '.join(f'{lp:g}' for lp in sample.logprobs)}): the weights hold no NaN or "
            "inf, but values large enough to overflow the forward pass"
        )
    return None
