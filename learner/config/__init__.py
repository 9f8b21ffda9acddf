"""Learner configuration: pydantic models loaded from TOML, with single-field CLI overrides.

Defaults live here, in code; a TOML file only says what differs. Unknown keys are errors (a typo
must not silently fall back to a default), and every error names the field and how to fix it.
"""

from __future__ import annotations

import re
import string
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from learner.config.base import FieldError, Section
from learner.config.deepspeed import DeepSpeedConfig
from learner.config.hints import DOCS, unknown_field_hint, unparsed_list
from learner.config.moe import ROUTING_REPLAY, routing_replay_refusal
from learner.config.rollout import RolloutConfig
from learner.config.step import GRPOConfig, OptimConfig
from rollout_server.protocol.generation import (
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
)


class LoraConfig(Section):
    r: int = Field(16, ge=1, description="the adapters' rank")
    alpha: int = Field(32, ge=1, description="LoRA alpha: the update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="the modules that get adapters: names such as ['q_proj', 'v_proj'], or "
        "'all-linear' (every linear layer but the LM head)",
    )
    adapter_dtype: Literal["float32", "model"] = Field(
        "float32",
        description="float32 (PEFT's default: precise updates, but each adapted layer's input "
        "is cast to float32 and kept for the backward) or 'model' (the model's dtype: less "
        "activation memory for bf16/fp16 models)",
    )
    quantization: Literal["none", "nf4", "fp4"] = Field(
        "none",
        description="QLoRA: load the frozen base weights 4-bit with bitsandbytes ('nf4' or "
        "'fp4', double quantization, compute in model.dtype); needs the qlora extra, no DeepSpeed",
    )


class ModelConfig(Section):
    name_or_path: str = Field(
        "tiny",
        description="hub id or local path; 'tiny' builds a random-weight tiny Qwen3 in the run dir",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the dtype the learner loads and trains the model in"
    )
    tiny: dict[str, int] = Field(
        default_factory=dict, description="overrides for the tiny model (hidden_size, layers…)"
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="recompute activations in backward; 'auto': only where the largest "
        "micro-batch's activations would not fit the GPU otherwise (learner.model.plan; the "
        "learner logs its choice)",
    )
    memory_budget_gb: float | None = Field(
        None,
        gt=0,
        description="GPU memory (GiB a GPU) the 'auto' choices of gradient_checkpointing and "
        "deepspeed.zero_stage may plan for; none: 90 % of the GPU's total. Lower it by what a "
        "rollout server sharing the GPU holds while the learner trains",
    )
    activation_offloading: bool = Field(
        False, description="park saved activations in pinned CPU memory (side-stream copies)"
    )
    lora: LoraConfig | None = Field(None, description="train PEFT LoRA adapters only")
    routing_replay: Literal["off", "r2", "r3"] = Field("off", description=ROUTING_REPLAY)
    trust_remote_code: bool = Field(
        False, description="let transformers run the model repository's own Python code"
    )
    attn_implementation: str | None = Field(
        None, description="e.g. 'flash_attention_2', 'sdpa'; None = transformers' default"
    )
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile each decoder layer in place (one graph shared by all layers, "
        "dynamic shapes): fuses the norms, activations and rotary embeddings; the first step "
        "pays the compilation; under DeepSpeed only with ZeRO-2 (or lower). 'auto': on a GPU "
        "where the training layout allows it (not ZeRO-3, not QLoRA)",
    )


_DATA_PATH = (
    "a .jsonl, .parquet, .csv or .json file, a datasets directory (save_to_disk, or data files "
    "laid out as on the Hub), or a Hugging Face Hub dataset id such as openai/gsm8k"
)


def _template_error(template: str) -> str | None:
    """What is wrong with a ``prompt_template``'s syntax (``str.format``, fields naming
    columns: ``learner.data.prompts.PromptFormat``), or None."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        return f"{e} (write {{{{ and }}}} for literal braces)"
    for field in fields:
        column = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not column or column.isdigit():
            return (
                f"{{{field}}} names no column: fields are column names, as in {{question}}; "
                "write {{ and }} for literal braces, e.g. \\boxed{{}}"
            )
    return None


class DataConfig(Section):
    path: str = Field(description=_DATA_PATH)
    split: str = Field("train", description="for a Hub id or a dataset directory: the split")
    subset: str | None = Field(
        None, description="for a Hub id or a dataset directory: the config name (gsm8k: main)"
    )
    prompt_column: str = Field(
        "prompt", description="the column holding each prompt (a string or chat messages)"
    )
    prompt_template: str | None = Field(
        None,
        description="builds each prompt from the row's columns, str.format syntax: "
        "'Solve: {question}' ({{ and }} for literal braces); the result goes to prompt_column",
    )
    system_prompt: str | None = Field(None, description="a system message put before each prompt")
    chat: bool = Field(
        True,
        description="with prompt_template: true makes the prompt a user message (the model's chat "
        "template applies), false plain text (a base model)",
    )
    shuffle: bool = Field(True, description="reshuffle the prompts each pass over the data")
    seed: int = Field(0, description="the shuffle's seed (a resumed run checks it is the same)")

    @model_validator(mode="after")
    def _prompt_format(self) -> DataConfig:
        if self.prompt_template is not None and (err := _template_error(self.prompt_template)):
            raise FieldError("prompt_template", err)
        if self.system_prompt is not None and not self.chat:
            raise FieldError(
                "system_prompt",
                "plain-text prompts (chat = false) have no system message: put the instructions "
                "in prompt_template, or set chat = true",
            )
        return self


class SamplingConfig(Section):
    num_generations: int = Field(8, ge=2, description="G: completions per prompt (>= 2)")
    max_tokens: int = Field(256, ge=1, description="the longest completion, in tokens")
    # the rollout server's bounds (rollout_server.protocol.SamplingParams), checked at load
    temperature: float = Field(
        1.0,
        ge=MIN_TEMPERATURE,
        le=100,
        description="sampling temperature; the learner divides its logits by it too, so its "
        "log-probs are those of the distribution sampled from",
    )
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1, description="nucleus sampling: 1 disables it")
    top_k: int = Field(-1, ge=-1, description="-1 or 0 disables top-k")
    min_p: float = Field(
        0.0, ge=0, le=1, description="drop tokens below this fraction of the top one's probability"
    )
    repetition_penalty: float = Field(
        1.0,
        ge=MIN_REPETITION_PENALTY,
        le=10,
        description="> 1 discourages tokens already in the sequence; 1: off",
    )
    stop: list[str] = Field(
        default_factory=list, description="strings that end a completion where they appear"
    )
    ignore_eos: bool = Field(False, description="always generate max_tokens (benchmarks)")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra arguments of the tokenizer's chat template, e.g. "
        "{enable_thinking = false}",
    )
    seed: int | None = Field(
        None,
        ge=0,
        description="seed every generation request from this, the step and the rank (and the "
        "episode and turn): a rerun or a resumed run draws the same samples (exactly on the "
        "transformers engine; on vLLM up to its batch-dependent numerics). None: unseeded",
    )


class RewardConfig(Section):
    name: str = Field(description="a registered reward (python -m rewards list)")
    weight: float = Field(1.0, description="its factor in the summed reward")
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments passed to the reward function (checked against its "
        "parameters)",
    )
    label: str | None = Field(
        None, description="its name in the metrics (default: name); set it to use one twice"
    )


class EnvironmentConfig(Section):
    """Train on a multi-turn environment instead of a dataset + reward functions."""

    name: str = Field(
        description="a registered environment (python -m rewards list), or "
        "'openreward:<url or owner/env>' for one served over the Open Reward Standard"
    )
    split: str = Field("train", description="the environment's split of tasks to train on")
    max_turns: int = Field(4, ge=1, description="generations per episode")
    reward_reduce: Literal["last", "sum", "mean"] = Field(
        "last",
        description="an episode's reward from its steps' rewards: the last given, their sum or "
        "their mean",
    )
    max_episode_tokens: int | None = Field(None, ge=1, description="stop an episode this long")
    episode_timeout_s: float | None = Field(
        300.0, gt=0, description="wall-clock limit of one episode; none: no limit"
    )


class ScoringConfig(Section):
    timeout_s: float = Field(
        60.0, gt=0, description="the longest one reward function may take over a batch"
    )
    policy: Literal["raise", "none", "zero"] = Field(
        "raise",
        description="a reward function that fails or times out: raise stops the run; none "
        "(it abstains on that batch) or zero (it scores 0.0) goes on, counted in "
        "reward/<name>/failures",
    )


class EvalConfig(Section):
    """Held-out prompts scored with the run's rewards every ``every`` steps (learner/evaluate.py)."""

    data: str | None = Field(
        None,
        description="held-out prompts, read as data.path, columns as [data] and prompts built as "
        "[data]'s (prompt_template, system_prompt); with an [environment]: none, the tasks of "
        "`split`",
    )
    prompt_column: str = Field("prompt", description="the column of eval.data holding the prompts")
    split: str = Field(
        "test",
        description="the split to evaluate: an [environment]'s tasks, or a Hub id's or dataset "
        "directory's rows",
    )
    subset: str | None = Field(
        None,
        description="the config name of a Hub id or dataset directory (default: data.subset "
        "when eval.data is data.path)",
    )
    every: int = Field(50, ge=1, description="evaluate every this many steps, and after the last")
    at_start: bool = Field(False, description="also evaluate the starting weights, as step 0")
    max_prompts: int | None = Field(None, ge=1, description="only the first this many rows")
    num_generations: int = Field(1, ge=1, description="samples per prompt")
    temperature: float = Field(0.0, ge=0, le=100, description="0: greedy")
    max_tokens: int | None = Field(None, ge=1, description="default: sampling.max_tokens")
    save_samples: bool = Field(
        True, description="write every sample and its rewards to RUN_DIR/eval/step_N.jsonl"
    )

    @model_validator(mode="after")
    def _greedy_once(self) -> EvalConfig:
        if self.temperature == 0 and self.num_generations > 1:
            raise FieldError(
                "num_generations",
                f"greedy decoding (temperature = 0) gives {self.num_generations} identical "
                f"samples: set eval.temperature > 0, or eval.num_generations = 1",
            )
        return self


class RunConfig(Section):
    steps: int = Field(100, ge=1, description="optimizer steps to train")
    seed: int = Field(0, description="seeds Python's, NumPy's and torch's RNGs at the start")
    run_dir: str = Field(
        "runs/grpo", description="where checkpoints, metrics and the final model go (--run-dir)"
    )
    checkpoint_every: int = Field(
        10, ge=1, description="save a checkpoint every this many steps, and after the last"
    )
    keep_checkpoints: int = Field(2, ge=1, description="the newest checkpoints kept; older ones go")
    tensorboard: bool = Field(
        True, description="also write TensorBoard events to RUN_DIR/tensorboard"
    )
    report_to: list[
        Literal["wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "trackio", "swanlab"]
    ] = Field(
        default_factory=list,
        description="experiment trackers (accelerate's) that get every step's metrics and the "
        "config, besides metrics.jsonl and TensorBoard; each needs its package installed",
    )
    project: str = Field("grpo-service", description="the trackers' project")
    tracker_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="per tracker, more arguments of its init: {wandb = {entity = 'me'}}",
    )
    progress_bar: bool = Field(True, description="a tqdm progress bar on the console")
    save_final: bool = Field(True, description="write RUN_DIR/final (model + tokenizer) at the end")
    peak_tflops: float | None = Field(
        None, description="for MFU; default: known GPUs' dense bf16 peak, none on CPU"
    )
    profile_steps: list[int] = Field(
        default_factory=list,
        description="steps whose train phase runs under torch.profiler (main process): "
        "RUN_DIR/profile/step_N.txt, the ops by host and by device time",
    )
    profile_trace: bool = Field(
        False,
        description="with profile_steps: also RUN_DIR/profile/step_N.trace.json (Chrome/Perfetto; "
        "tens of MB for a real model)",
    )

    @model_validator(mode="after")
    def _tracker_kwargs_name_trackers(self) -> RunConfig:
        if stray := sorted(set(self.tracker_kwargs) - set(self.report_to)):
            raise FieldError(
                "tracker_kwargs",
                f"{stray} not in run.report_to {self.report_to}: add them there, or drop them",
            )
        return self

    @model_validator(mode="after")
    def _profile_steps_in_range(self) -> RunConfig:
        bad = [s for s in self.profile_steps if not 1 <= s <= self.steps]
        if bad:
            raise ValueError(f"run.profile_steps {bad} outside 1..run.steps ({self.steps})")
        return self


class SFTConfig(Section):
    """Supervised fine-tuning: ``python -m learner sft``, or a warm start before GRPO in one run.

    Rows hold chat ``messages`` (the loss covers the assistant turns only) or ``prompt`` and
    ``completion`` (the loss covers the completion only). Optimizer betas, weight decay and the
    gradient-norm clip come from [optim]; checkpoint cadence, seed and logging from [run]."""

    data: str = Field(description=_DATA_PATH)
    split: str = Field("train", description="for a Hub id or a dataset directory: the split")
    subset: str | None = Field(None, description="for a Hub id or a dataset directory: its config")
    messages_column: str = Field(
        "messages", description="the column of chat messages (the loss covers assistant turns)"
    )
    prompt_column: str = Field(
        "prompt", description="without messages: the column of prompts (no loss on them)"
    )
    completion_column: str = Field(
        "completion", description="with prompt_column: the column of completions (the loss)"
    )
    steps: int | None = Field(None, ge=1, description="optimizer steps (or give epochs)")
    epochs: float | None = Field(None, gt=0, description="passes over the data; default 1")
    batch_size: int = Field(8, ge=1, description="sequences per optimizer step (all ranks)")
    micro_batch_size: int = Field(4, ge=1, description="sequences per forward/backward")
    max_length: int = Field(2048, ge=2, description="longer sequences lose their end")
    lr: float = Field(2e-5, gt=0, description="the SFT's peak learning rate (not optim.lr)")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "cosine", description="the learning rate after warmup, over the SFT's steps"
    )
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup from 0 to lr")
    fused_loss: bool = Field(
        True,
        description="the NLL fused with the LM head (3 N·H·V products instead of 4, one chunk of "
        "bf16 logits in memory: grpo.fused_chunk_size tokens); false: log-probs with the logits "
        "recomputed in the backward (grpo.logprob_chunk_size tokens, less memory, slower)",
    )

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> SFTConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give sft.steps or sft.epochs, not both")
        return self


class LearnerConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    data: DataConfig | None = Field(
        None, description="the prompts to train on, scored by the [[rewards]]"
    )
    environment: EnvironmentConfig | None = Field(
        None, description="instead of [data] and [[rewards]]: multi-turn episodes"
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="the rollout servers, how the learner reaches them and syncs their weights",
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="how the rollout servers sample completions"
    )
    rewards: list[RewardConfig] = Field(
        default_factory=list, description="the reward functions, summed with their weights"
    )
    scoring: ScoringConfig = Field(
        default_factory=ScoringConfig, description="how the reward functions are run"
    )
    grpo: GRPOConfig = Field(
        default_factory=GRPOConfig, description="the GRPO batch, loss and its variants"
    )
    deepspeed: DeepSpeedConfig = Field(
        default_factory=DeepSpeedConfig,
        description="the ZeRO stage and its bucket sizes, under a DeepSpeed launch",
    )
    optim: OptimConfig = Field(
        default_factory=OptimConfig, description="the optimizer (AdamW) and learning rate"
    )
    run: RunConfig = Field(
        default_factory=RunConfig, description="length, checkpoints, logging and profiling"
    )
    sft: SFTConfig | None = Field(
        None, description="supervised warm start: runs before GRPO (or alone: `learner sft`)"
    )
    eval: EvalConfig | None = Field(None, description="held-out evaluation while training")

    @field_validator("environment", mode="before")
    @classmethod
    def _environment_name(cls, v: Any) -> Any:
        """``environment = "name"`` is short for an [environment] table with only ``name``."""
        return {"name": v} if isinstance(v, str) else v

    @property
    def has_grpo(self) -> bool:
        """False for an SFT-only config (no [data] or [environment] to run GRPO on)."""
        return self.data is not None or self.environment is not None

    def _check_lora_sync(self) -> None:
        """rollout.sync.lora = "adapter" needs adapters to send, servers holding the base
        weights they go on, and a base that is the learner's."""
        rollout, lora = self.rollout, self.model.lora
        if rollout.sync.lora != "adapter":
            return
        if lora is None:
            raise ValueError('rollout.sync.lora = "adapter" needs model.lora (adapters to send)')
        if lora.quantization != "none":
            raise ValueError(
                'rollout.sync.lora = "adapter" with QLoRA: the servers would serve the adapters '
                "on the full-precision checkpoint, not on the 4-bit base the learner trains "
                'them on (another policy); use lora = "merged"'
            )
        if rollout.sleep_while_training == 2:
            raise ValueError(
                'rollout.sync.lora = "adapter" with sleep_while_training = 2: level 2 discards '
                "the servers' base weights, which an adapter sync never sends; use level 1"
            )
        if self.sft is not None and self.has_grpo and rollout.external:
            raise ValueError(
                'rollout.sync.lora = "adapter" with an [sft] warm start and rollout.servers: '
                "the servers hold the checkpoint they started from, not the SFT model GRPO's "
                'adapters train on, and an adapter sync never sends it; use lora = "merged" '
                "or the embedded server (it starts from the SFT model)"
            )

    @model_validator(mode="after")
    def _one_source_of_rewards(self) -> LearnerConfig:
        if self.sft is not None and not self.has_grpo and not self.rewards:
            return self  # SFT only: `python -m learner sft`
        if self.environment is None:
            if self.data is None or not self.rewards:
                raise ValueError(
                    "give either [data] and at least one [[rewards]], or an [environment]"
                )
        elif self.data is not None or self.rewards:
            raise ValueError(
                "[environment] supplies both the tasks and the reward: remove [data] and [[rewards]]"
            )
        if self.eval is not None and (self.environment is None) == (self.eval.data is None):
            raise ValueError(
                "[eval] takes `data` (held-out prompts for the [[rewards]]) without an "
                "[environment], and `split` (the environment's held-out tasks) with one"
            )
        self._check_lora_sync()
        if why := routing_replay_refusal(self):
            raise ValueError(why)
        keys = [r.label or r.name for r in self.rewards]
        if twice := sorted({k for k in keys if keys.count(k) > 1}):
            raise ValueError(
                f"[[rewards]] {twice} appear more than once: give each a distinct `label` "
                f"(its name in the metrics)"
            )
        return self


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field and the fix."""


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid learner config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if isinstance(field_error := e.get("ctx", {}).get("error"), FieldError):
            loc, msg = f"{loc}.{field_error.field}", field_error.message
        elif (
            e["type"] == "extra_forbidden"
            and len(e["loc"]) == 2
            and (e["loc"][1] in LearnerConfig.model_fields)
        ):
            msg = (
                f"{e['loc'][1]!r} is a top-level key, not a field of [{e['loc'][0]}]: put it above "
                f"the first [section] of the file (a TOML key belongs to the [section] above it)"
            )
        elif e["type"] == "extra_forbidden":
            hint = unknown_field_hint(LearnerConfig, tuple(e["loc"]))
            msg = f"unknown field — {hint or 'check its spelling and section'} (see {DOCS})"
        elif e["type"] == "list_type":
            msg = (
                f'{msg}: give a TOML list, e.g. {loc.rsplit(".", 1)[-1]} = ["a", "b"] in '
                f'the file, or --set \'{loc}=["a", "b"]\' (single quotes around the whole)'
            )
        elif e["type"] == "missing":
            msg = "required field is missing — add it to the config"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def _parse_value(raw: str) -> Any:
    """A CLI override's value, read as a TOML value where it is one, else as a plain string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


# Tables a string may stand for: `environment = "gsm8k"` is [environment] name = "gsm8k", and
# `rollout.sync = "nccl"` is [rollout.sync] type = "nccl"; an override inside one expands it.
_SHORTHANDS = {"environment": "name", "rollout.sync": "type"}


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply ``section.field=value`` (value in TOML syntax; bare words are strings)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.field=value")
    key, raw = override.split("=", 1)
    if (unparsed := unparsed_list(key.strip(), raw)) is not None:
        raise ConfigError(unparsed)
    parts = key.strip().split(".")
    node = data
    for i, p in enumerate(parts[:-1]):
        short = _SHORTHANDS.get(".".join(parts[: i + 1]))
        if short is not None and isinstance(node.get(p), str):  # `environment = "name"`
            node[p] = {short: node[p]}
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {p!r} is not a section")
    node[parts[-1]] = _parse_value(raw.strip())


def _config_text(path: Path) -> str:
    """The config file as text: UTF-8, as TOML requires, or a ``ConfigError`` naming the line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{path}:{line} is not UTF-8 text (byte 0x{raw[e.start]:02x}): TOML must be UTF-8; "
            "convert the file, e.g. `iconv -f latin1 -t utf-8 FILE > NEW`"
        ) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> LearnerConfig:
    data: dict[str, Any] = {}
    source = "overrides"
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory: name a .toml file in it")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(_config_text(path))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from e
        source = str(path)
    for o in overrides or []:
        apply_override(data, o)
    if isinstance(path, Path):  # relative data paths are relative to the config file
        for section, key in (("data", "path"), ("sft", "data"), ("eval", "data")):
            d = data.get(section)
            if isinstance(d, dict) and isinstance(d.get(key), str):
                rel = path.parent / d[key]
                if not Path(d[key]).is_absolute() and rel.exists():
                    d[key] = str(rel.resolve())
    try:
        return LearnerConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None
