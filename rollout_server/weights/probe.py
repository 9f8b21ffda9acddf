"""The check a new weight version passes before it is served: one short fixed greedy
generation whose log-probs must all be finite.

Every update's values are scanned for NaN/inf before they load, but finite weights can still
overflow the forward pass (a norm weight of 3e38): such a version would answer every
generation with an error. The probe runs right after the load, under the pause gate's write
side (no generation sees the weights before it passed), on every transport and both engines
(it is the engine's own ``generate``). After a failed probe, ``load_probed`` restores the
previous weights where the engine kept a copy, and otherwise marks the server not ready until
an update passes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, TypeVar

from rollout_server.errors import BadRequest, ServiceError
from rollout_server.protocol import SamplingParams

if TYPE_CHECKING:
    from rollout_server.core import ServerCore
    from rollout_server.engine.base import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")


class WeightsRefusedByProbe(BadRequest):
    """The update's weights fail the probe; the previous ones were restored (400)."""


class UnservableWeights(ServiceError):
    """The update's weights fail the probe and could not be undone (500): the server is not
    ready until an update passes."""

    status_code = 500


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


async def load_probed(
    core: ServerCore,
    load: Callable[[], Awaitable[T]],
    names: Collection[str],
    *,
    rollback: bool = True,
) -> T:
    """``load()`` under the write gate (held by the caller), then ``probe_generation`` when
    the server would be ready to generate. A failed
    probe restores the named tensors as they were (``rollback`` and an engine that kept a
    copy: 400, the previous version serves on), or else leaves the server not ready (503
    on /ready and generation) until an update passes (500). The version does not move."""
    probe = core.servable_after(names)
    snapshot = None
    if probe and rollback and names:
        snapshot = await core.engine.snapshot_weights(names)
    result = await load()
    if not probe:
        return result
    problem = await probe_generation(core.engine)
    if problem is None:
        core.unservable = None
        return result
    log.warning("a weight update failed its probe: %s", problem)
    if snapshot is not None:
        await core.engine.restore_weights(snapshot)
        await core.engine.reset_prefix_cache()
        raise WeightsRefusedByProbe(
            f"weight update refused: {problem}; the previous weights (version "
            f"{core.version}) were restored and serve on"
        )
    core.unservable = problem
    raise UnservableWeights(
        f"the weight update loaded but cannot generate: {problem}; the engine kept no copy "
        f"of the previous weights, so /ready and generation answer 503 until an update "
        f"whose probe passes loads (the version stays {core.version})"
    )
