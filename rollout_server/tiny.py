"""Tiny random-weight Qwen3 models with a byte-level tokenizer, built offline.

Tests, the demo and the GPU machine cannot download models, so they build one here: a real
``Qwen3ForCausalLM`` (random weights) and a real fast tokenizer whose vocabulary is the 256 bytes
plus Qwen's special tokens, with a ChatML chat template that renders tools the way Qwen does.
Everything is saved with ``save_pretrained``, so any engine loads it like a hub model.

    python -m rollout_server.tiny /tmp/tiny                     # hidden 64, 2 layers
    python -m rollout_server.tiny /tmp/q06 --qwen3-0.6b-shape   # random weights, real shape
    python -m rollout_server.tiny /tmp/moe --moe qwen3_moe      # 8 experts, 2 per token

``--moe`` builds a mixture-of-experts model instead (``rollout_server.tiny_moe``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_server.tiny_moe import MOE_FAMILIES, moe_model_class, tiny_moe_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3Config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not "special": they survive ``skip_special_tokens`` in decoded text, as in Qwen3.
ADDED_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Qwen-style ChatML. Tools go into the system turn, assistant tool calls are rendered as
# <tool_call>{json}</tool_call>, and tool results as <tool_response> blocks inside one user turn.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
      or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

QWEN3_0_6B_SHAPE: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}

# Qwen3-4B (4.0B parameters, ~8 GB in bf16): a weight-sync size where bandwidth dominates
QWEN3_4B_SHAPE: dict[str, Any] = {
    **QWEN3_0_6B_SHAPE,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel decoder inverts)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level fast tokenizer: ids 0-255 are the bytes, then the special and added tokens.

    Any text round-trips exactly (every byte has a token), so tests can compare text and ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    return tokenizer


def tiny_qwen3_config(
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 2048,
    **overrides: Any,
) -> Qwen3Config:
    from transformers import Qwen3Config

    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
    }
    fields.update(overrides)
    return Qwen3Config(**fields)


def save_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    moe: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight Qwen3 model (config, safetensors, tokenizer) to ``path``.

    ``config_overrides`` take ``tiny_qwen3_config``'s argument names (``hidden``, ``layers``...)
    or any ``Qwen3Config`` field. The model's vocab may exceed the tokenizer's (as in real Qwen3)
    but never be smaller. ``moe``: a mixture-of-experts family of ``tiny_moe.MOE_FAMILIES``
    instead (overrides: ``tiny_moe_config``'s names, e.g. ``experts``, or its config's fields)."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    vocab_size = config_overrides.pop("vocab_size", None) or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)"
        )
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    special = {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None}
    if moe is not None:
        config = tiny_moe_config(moe, vocab_size, **special, **config_overrides)
        model_class = moe_model_class(moe)
    else:
        config = tiny_qwen3_config(vocab_size, **special, **config_overrides)
        model_class = Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    portable_tokenizer_class(path / "tokenizer_config.json")
    return path


def portable_tokenizer_class(config_path: Path) -> None:
    """transformers 5 writes a tokenizer built from ``tokenizer.json`` as ``TokenizersBackend``,
    which transformers 4 (still pinned by some vLLM releases, which serve the model next) cannot
    resolve; ``PreTrainedTokenizerFast`` loads in both."""
    import json

    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rollout_server.tiny",
        description="Write a random-weight Qwen3 model and a byte-level tokenizer to PATH.",
    )
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="model vocab (>= tokenizer's 265)"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument(
        "--moe", choices=MOE_FAMILIES, default=None, help="a mixture-of-experts model instead"
    )
    parser.add_argument("--experts", type=int, default=8, help="--moe: experts a layer")
    parser.add_argument("--experts-per-token", type=int, default=2, help="--moe: routed top-k")
    parser.add_argument(
        "--expert-intermediate", type=int, default=32, help="--moe: each expert's MLP width"
    )
    parser.add_argument(
        "--qwen3-0.6b-shape",
        dest="qwen3_shape",
        action="store_true",
        help="the real Qwen3-0.6B shape (vocab 151936, 28 layers; ~1.2 GB in bf16)",
    )
    parser.add_argument(
        "--qwen3-4b-shape",
        dest="qwen3_4b_shape",
        action="store_true",
        help="the real Qwen3-4B shape (hidden 2560, 36 layers; ~8 GB in bf16)",
    )
    args = parser.parse_args(argv)
    if args.qwen3_shape or args.qwen3_4b_shape:
        overrides = dict(QWEN3_4B_SHAPE if args.qwen3_4b_shape else QWEN3_0_6B_SHAPE)
        dtype = args.dtype or "bfloat16"
    else:
        overrides = {
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "intermediate": args.intermediate,
            "vocab_size": args.vocab_size,
        }
        if args.moe is not None:
            overrides |= {
                "experts": args.experts,
                "experts_per_token": args.experts_per_token,
                "expert_intermediate": args.expert_intermediate,
            }
        dtype = args.dtype or "float32"
    if args.moe is not None and (args.qwen3_shape or args.qwen3_4b_shape):
        parser.error("--moe builds a tiny shape: leave out --qwen3-0.6b-shape/--qwen3-4b-shape")
    out = save_tiny_model(args.path, seed=args.seed, dtype=dtype, moe=args.moe, **overrides)
    print(out)


if __name__ == "__main__":
    main()
