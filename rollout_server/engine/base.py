"""The engine interface: what the HTTP layer needs from a generation backend.

Two engines implement it: ``TransformersEngine`` (CPU / small GPU, the embedded default and the
test engine) and ``VLLMEngine`` (vLLM ``AsyncLLM`` on GPUs). The app never imports either
directly; ``rollout_server.engine.load_engine`` picks one by name, importing it lazily.

Concurrency contract: ``generate`` may be called concurrently from the event loop and must not
block it. ``load_weights`` is only called by the app while generation is paused (no request in
flight), so engines need no locking of their own around weight loads.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout_server.engine.prompt_render import RENDER_DEADLINE_S, encode_text, render_chat

if TYPE_CHECKING:
    import torch

    from rollout_server.protocol import (
        FinishReason,
        IpcUpdateRequest,
        LoraAdapterSpec,
        NcclInitRequest,
        NcclUpdateRequest,
        RoutedExperts,
        SamplingParams,
    )


class EngineError(Exception):
    """A fault of the engine (5xx), as opposed to a bad request."""


class UnsupportedError(EngineError):
    """The engine does not support this operation (e.g. NCCL sync on the CPU engine)."""


class WeightsError(ValueError):
    """A weight update was refused (unknown name, wrong shape/dtype, unreadable data).

    Raised before anything is applied: the old weights keep serving."""


@dataclass(frozen=True)
class ReceivedUpdate:
    """What an engine reports of one announced (NCCL / CUDA IPC) update it loaded."""

    checksum: float | None = None  # of the received bytes, when the announce asked for one
    received_s: float | None = None  # receiving (NCCL: the wire) before anything loads
    loaded_s: float | None = None  # loading into the model
    loader: str | None = None  # how: "direct", "load_weights" or "load_weights+verify"
    prefix_cache_reset: bool = False  # the engine already reset its prefix cache
    timeline: dict[str, float] = field(default_factory=dict)  # stage -> time.time(), profiling


@dataclass(frozen=True)
class EngineInfo:
    model: str
    engine: str
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    weight_transports: list[str] = field(default_factory=lambda: ["http", "file"])
    max_num_seqs: int | None = None  # the batch limits in force (None: not known)
    max_batch_tokens: int | None = None


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the sampling distribution
    text: str
    finish_reason: FinishReason
    # the experts of its prompt and completion tokens but the last (``return_routed_experts``)
    routed_experts: RoutedExperts | None = None


@dataclass(frozen=True)
class TensorMeta:
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    # a tied alias of this other name (``lm_head.weight`` -> ``model.embed_tokens.weight``):
    # an update may carry either, the learner sends the other (``named_parameters()`` order)
    tied_to: str | None = None


def prompt_ids(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    max_chars: int | None = None,
    deadline_s: float | None = None,
) -> list[int]:
    """The token ids of a text prompt, or of chat messages through the chat template: what a
    server is given (the client of a stock vLLM server renders chat prompts with it too).

    ``max_chars``: text (rendered or given) longer than this is refused (``PromptTooLong``)
    before it is encoded; ``deadline_s``: the template's rendering time (``RenderTimeout``)."""
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt, max_chars=max_chars)
    text = render_chat(
        tokenizer,
        prompt,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs,
        tools=tools,
        deadline_s=deadline_s,
    )
    return encode_text(tokenizer, text, max_chars=max_chars, add_special_tokens=False)


class HFTokenizerMixin:
    """``Engine.tokenize_prompt`` and ``Engine.decode`` for engines built on a Hugging Face
    tokenizer (both are): the engine sets ``tokenizer``, ``_tokenizer_lock`` and
    ``_client_lock`` (HF fast tokenizers are not safe to share across threads).

    Client prompts are rendered and encoded with a copy of the tokenizer under a lock of their
    own: the decode loop detokenizes with the original under ``_tokenizer_lock``, so a client's
    template or a long text never holds up the decoding of other requests."""

    tokenizer: Any
    _tokenizer_lock: Any
    _client_lock: Any
    _client_tokenizer: Any = None
    render_deadline_s: float = RENDER_DEADLINE_S

    def tokenize_prompt(
        self,
        prompt: list[int] | str | list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        max_chars: int | None = None,
    ) -> list[int]:
        """Ids pass through, text is encoded, chat messages go through the chat template."""
        if not isinstance(prompt, str) and not (prompt and isinstance(prompt[0], dict)):
            return [int(t) for t in prompt]
        with self._client_lock:
            if self._client_tokenizer is None:
                with self._tokenizer_lock:
                    self._client_tokenizer = copy.deepcopy(self.tokenizer)
            return prompt_ids(
                self._client_tokenizer,
                prompt,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
                max_chars=max_chars,
                deadline_s=self.render_deadline_s,
            )

    def decode(self, token_ids: list[int]) -> str:
        """Text of sampled ids. The model's vocab may be larger than the tokenizer's (padding
        rows of the embedding): those ids are skipped."""
        known = [t for t in token_ids if t < len(self.tokenizer)]
        with self._tokenizer_lock:
            return self.tokenizer.decode(known, skip_special_tokens=True)


class Engine(abc.ABC):
    """A generation backend. Subclasses set ``name`` and implement the abstract methods."""

    name: str = "base"

    def routed_experts_refusal(self) -> str | None:
        """Why ``return_routed_experts`` cannot be served (None: it can)."""
        return (
            f"routing replay needs the transformers engine here (this server runs the "
            f"{self.name} engine): serve the model with --engine transformers, or set the "
            'learner\'s model.routing_replay = "off"'
        )

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model. Called once before the server reports ready."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the model and any worker processes."""

    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    def tokenize_prompt(
        self,
        prompt: list[int] | str | list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        max_chars: int | None = None,
    ) -> list[int]:
        """Token ids of a prompt: ids unchanged, text encoded, chat messages templated; text
        (given or rendered) longer than ``max_chars`` is refused before it is encoded."""

    @abc.abstractmethod
    def decode(self, token_ids: list[int]) -> str: ...

    @abc.abstractmethod
    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[SampleOutput]]:
        """``n`` samples for each prompt, as ``[prompt][sample]``.

        Cancelling the call (its client disconnected, or the server is stopping) must stop
        the work it queued, so that the next request is not kept waiting behind it."""

    @abc.abstractmethod
    def weight_metadata(self) -> dict[str, TensorMeta]:
        """Name -> dtype/shape of every tensor a weight update may carry (for validation)."""

    def required_weights(self) -> set[str]:
        """What sleep level 2 discards: the names a sync must load again before generating.
        Every tensor of ``weight_metadata`` but tied aliases (the name they are tied to is the
        one the learner sends; vLLM's loader skips a tied ``lm_head.weight``)."""
        return {name for name, meta in self.weight_metadata().items() if meta.tied_to is None}

    @abc.abstractmethod
    async def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy already-validated tensors into the model. Called with generation paused."""

    async def snapshot_weights(self, names: Iterable[str]) -> object | None:
        """A copy of the named tensors as they are served, for ``restore_weights`` to put back
        should the update that replaces them fail its probe; None: this engine keeps no copy
        (the vLLM engine: the weights live in its workers' GPU memory)."""
        return None

    async def restore_weights(self, snapshot: object) -> None:
        """Put back what ``snapshot_weights`` copied. Called with generation paused."""
        raise UnsupportedError(f"the {self.name} engine cannot restore weights")

    async def load_adapter(
        self, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor], version: int
    ) -> None:
        """Serve an already-validated LoRA adapter (PEFT names) on the base weights, as weight
        version ``version``; called with generation paused. All or nothing: if it fails, the
        previous adapter (or none) keeps serving. A later ``load_weights`` serves the base
        weights alone again."""
        raise UnsupportedError(f"the {self.name} engine cannot serve LoRA adapters")

    def check_adapter(self, spec: LoraAdapterSpec) -> None:
        """Refuse, before anything is paused or received, an adapter this engine cannot serve
        (an announced update's: its bytes would otherwise be sent for nothing)."""
        raise UnsupportedError(f"the {self.name} engine cannot serve LoRA adapters")

    def served_lora_rank(self) -> int | None:
        """The rank of the LoRA adapter served on the base weights, None without one."""
        return None

    async def reset_prefix_cache(self) -> None:  # noqa: B027
        """Drop cached KV for prompts (stale after a weight update). No-op by default."""

    @abc.abstractmethod
    async def sleep(self, level: int) -> None: ...

    @abc.abstractmethod
    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    @abc.abstractmethod
    def is_sleeping(self) -> bool: ...

    async def weights_checksum(self) -> float:
        """``rollout_server.weight_digest.params_checksum`` of the parameters the engine serves
        with (a shared one once): it sees every element's position and tensor's name, and is
        defined in vLLM's fused name space, so it equals the learner's over its own parameters
        when the weights are equal and in their places."""
        raise UnsupportedError(f"the {self.name} engine cannot checksum its weights")

    async def init_weight_group(self, request: NcclInitRequest) -> None:
        raise UnsupportedError(f"the {self.name} engine does not support NCCL weight sync")

    async def receive_nccl_update(self, request: NcclUpdateRequest) -> ReceivedUpdate:
        """Receive the announced buckets over NCCL, then load them all (or none). The result
        has a checksum of the loaded tensors when ``request.checksum`` is set."""
        raise UnsupportedError(f"the {self.name} engine does not support NCCL weight sync")

    async def prepare_nccl_update(self, request: NcclUpdateRequest) -> None:
        """Queue the announced update's receives ahead of the broadcast and reset the prefix
        cache; called paused, and the pause holds until ``commit_nccl_update`` waits for the
        bytes and loads."""
        raise UnsupportedError(f"the {self.name} engine does not support NCCL weight sync")

    async def commit_nccl_update(self, request: NcclUpdateRequest) -> ReceivedUpdate:
        """Load the update ``prepare_nccl_update`` queued (``request``), as
        ``receive_nccl_update`` does."""
        raise UnsupportedError(f"the {self.name} engine does not support NCCL weight sync")

    async def cancel_nccl_commit(self) -> bool:
        """End a commit that waits for a broadcast which will not come (the group is being
        formed again); the commit then fails and the previous weights keep serving. False if
        this engine cannot (the commit then runs until the group's timeout)."""
        return False

    async def drop_prepared_update(self) -> None:  # noqa: B027
        """Give up a prepared update (its receives end; the weight-sync group must be formed
        again)."""

    async def receive_ipc_update(self, request: IpcUpdateRequest) -> ReceivedUpdate:
        """Open the announced CUDA IPC buckets (learner on this GPU), then load them all (or
        none), as ``receive_nccl_update``."""
        raise UnsupportedError(
            f"the {self.name} engine does not support CUDA IPC weight sync (the vllm engine "
            "does); use sync = 'http' or 'file'"
        )
