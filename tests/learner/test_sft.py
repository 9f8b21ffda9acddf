"""SFT: which tokens are in the loss (by hand, byte-level tokenizer), the chunked loss against a
float64 full-logits cross entropy, gradient accumulation, a short run that learns and resumes
exactly, the GRPO warm start, and config / data errors.

The tiny tokenizer maps bytes to ids 0-255; then <|endoftext|> = 256, <|im_start|> = 257,
<|im_end|> = 258 (ChatML, as Qwen).
"""

from __future__ import annotations

import copy
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from learner.config import ConfigError, SFTConfig, load_config
from learner.data.prompts import DataError
from learner.data.sft import SFTExample, assistant_spans, load_sft_rows, tokenize_row
from learner.sft import example_rollout
from learner.step.batch import collate
from tests.learner.launch import cpu_launch

ROOT = Path(__file__).resolve().parents[2]
SFT_DEMO = ROOT / "learner" / "configs" / "sft_demo.toml"
DEMO = ROOT / "learner" / "configs" / "demo.toml"
START, END, EOT = 257, 258, 256


def b(text: str) -> list[int]:
    return list(text.encode())


@pytest.fixture(scope="module")
def tok():
    from rollout_server.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer()


def _cfg(**kw) -> SFTConfig:
    return SFTConfig(data="unused.jsonl", **kw)


def _targets(ex: SFTExample) -> list[int]:
    return [i for i, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]


# --- which tokens are trained on -------------------------------------------------------------


def test_chat_rows_train_on_assistant_turns_only(tok):
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ab"},
    ]
    ex = tokenize_row(tok, {"messages": msgs}, _cfg(), "messages")
    expected_ids = [
        *[START, *b("system\nS"), END, *b("\n")],
        *[START, *b("user\nhi"), END, *b("\n")],
        *[START, *b("assistant\n"), *b("yo"), END, *b("\n")],
        *[START, *b("user\nq"), END, *b("\n")],
        *[START, *b("assistant\n"), *b("ab"), END, *b("\n")],
    ]
    assert ex.input_ids == expected_ids
    # each assistant turn: its content, <|im_end|> and the template's newline; never its header
    assert _targets(ex) == [*b("yo"), END, 10, *b("ab"), END, 10]
    assert ex.num_targets == 8


def test_tool_turns_are_masked_and_tool_calls_trained(tok):
    call = {"function": {"name": "add", "arguments": {"a": 1}}}
    msgs = [
        {"role": "user", "content": "1+?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "2"},
    ]
    ex = tokenize_row(tok, {"messages": msgs}, _cfg(), "messages")
    call_text = '\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    tool_call_id, tool_call_end = 261, 262  # added tokens after the specials
    expected = [tool_call_id, *b('\n{"name": "add", "arguments": {"a": 1}}\n'), tool_call_end]
    expected += [END, 10, *b("2"), END, 10]  # the tool's output (a user turn) is context only
    assert call_text in tok.decode(ex.input_ids)
    assert _targets(ex) == expected


def test_text_prompt_completion_trains_on_completion_and_eos(tok):
    cfg = _cfg()
    ex = tokenize_row(tok, {"prompt": "ab", "completion": "cd"}, cfg, "prompt_completion")
    assert ex.input_ids == [*b("abcd"), END]
    assert ex.loss_mask == [0, 0, 1, 1, 1]
    done = tokenize_row(
        tok, {"prompt": "ab", "completion": "cd<|im_end|>"}, cfg, "prompt_completion"
    )
    assert done.input_ids == [*b("abcd"), END]  # no second EOS


def test_chat_prompt_completion_trains_on_the_completion_turn_only(tok):
    prompt = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "bb"},  # an earlier turn: context, not a target
        {"role": "user", "content": "c"},
    ]
    row = {"prompt": prompt, "completion": [{"role": "assistant", "content": "dd"}]}
    ex = tokenize_row(tok, row, _cfg(), "prompt_completion")
    assert _targets(ex) == [*b("dd"), END, 10]
    as_text = tokenize_row(tok, {"prompt": prompt, "completion": "dd"}, _cfg(), "prompt_completion")
    assert as_text == ex


def test_collate_aligns_the_mask_with_targets_and_truncation_cuts_the_end(tok):
    row = {"prompt": "xy", "completion": "zw"}
    ex = tokenize_row(tok, row, _cfg(), "prompt_completion")  # x y z w <|im_end|>
    short = ex.truncate(4)
    assert short.input_ids == b("xyzw") and short.num_targets == 2
    batch = collate(
        [
            example_rollout(ex, EOT),
            example_rollout(short, EOT),
            example_rollout(SFTExample([5], [1]), EOT),
        ],
        EOT,
    )
    # position t predicts token t+1: targets z, w, <|im_end|> sit at positions 1, 2, 3
    assert batch.loss_mask.tolist() == [[0, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]]
    sel = batch.loss_mask.bool()
    assert batch.input_ids[:, 1:][sel].tolist() == [*b("zw"), END, *b("zw")]


def test_template_that_rewrites_earlier_turns_is_refused_with_the_fix(tok):
    tok = copy.deepcopy(tok)  # a Qwen3-like template: only the last assistant turn keeps text
    tok.chat_template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role != 'assistant' or loop.last %}{{ m.content }}{%- endif %}<|im_end|>\n"
        "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2
    with pytest.raises(DataError, match=r"prompt .* completion"):
        assistant_spans(tok, msgs)


def test_data_errors_name_the_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DataError, match=r"neither 'messages' nor 'prompt'.*sft\.messages_column"):
        load_sft_rows(SFTConfig(data=str(path)))
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match="no 'completion' column"):
        load_sft_rows(SFTConfig(data=str(path)))
    path.write_text(json.dumps({"prompt": "x", "answer": "y"}) + "\n")
    rows, fmt = load_sft_rows(SFTConfig(data=str(path), completion_column="answer"))
    assert fmt == "prompt_completion" and rows == [{"prompt": "x", "answer": "y"}]
    user_only = {"messages": [{"role": "user", "content": "x"}]}
    path.write_text(json.dumps(user_only) + "\n")
    with pytest.raises(DataError, match="no row has an assistant turn in 'messages', so there"):
        load_sft_rows(SFTConfig(data=str(path)))
    path.write_text(json.dumps({"prompt": "x", "completion": ""}) + "\n")
    with pytest.raises(DataError, match="no row has a non-empty 'completion'"):
        load_sft_rows(SFTConfig(data=str(path)))


def test_sft_data_from_a_hub_layout_subset_and_split(tmp_path):
    from tests.learner.test_config_data_batch import write_hub_layout

    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    other = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    splits = {"train": [{"messages": other}], "test": [{"messages": chat}]}
    hub = write_hub_layout(tmp_path / "hub", splits)
    rows, fmt = load_sft_rows(SFTConfig(data=str(hub), subset="main", split="test"))
    assert fmt == "messages" and rows == [{"messages": chat}]
    with pytest.raises(DataError, match=r"Unknown split \"dev\".* Set sft\.split"):
        load_sft_rows(SFTConfig(data=str(hub), subset="main", split="dev"))


# --- the loss --------------------------------------------------------------------------------


def _rollouts(tok):
    rows = [
        {"prompt": "hello ", "completion": "world"},
        {"prompt": [{"role": "user", "content": "hi"}], "completion": "a longer answer"},
        {"prompt": "p", "completion": "q"},
    ]
    return [example_rollout(tokenize_row(tok, r, _cfg(), "prompt_completion"), EOT) for r in rows]


def _tiny_model(seed: int, tie: bool = True):
    from transformers import Qwen3ForCausalLM

    from rollout_server.tiny import tiny_qwen3_config

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(265, tie_word_embeddings=tie)).double()


@pytest.mark.parametrize("fused", [False, True], ids=["logprobs", "fused"])
@pytest.mark.parametrize("tie", [True, False])
def test_chunked_loss_equals_full_logits_cross_entropy_float64(tok, tie, fused):
    """Both chunked paths (``sft.fused_loss`` off: log-probs, logits recomputed in the
    backward; on: the NLL fused with the head, gradients in the forward), chunks of 3 tokens."""
    from learner.sft import NLLPolicy

    batch = collate(_rollouts(tok), EOT)  # right-padded rows of different lengths
    model = _tiny_model(0, tie)
    ref_model = copy.deepcopy(model)
    policy = NLLPolicy(model, chunk_size=3, fused=fused, fused_chunk_size=3)
    nll = policy(batch.input_ids, batch.attention_mask, batch.loss_mask)
    nll.backward()

    logits = ref_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    labels = batch.input_ids[:, 1:].masked_fill(batch.loss_mask == 0, -100)  # [B, T-1]
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))
    ref.backward()
    assert nll.dtype == torch.float64
    torch.testing.assert_close(nll, ref, rtol=1e-12, atol=1e-12)
    grads = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-9, atol=1e-12, msg=name)


def test_accumulated_micro_batches_equal_one_batch(tok):
    """Micro-batches of 1 and one batch of 3 give the same step: the mean over all targets."""
    from accelerate import Accelerator

    from learner.sft import NLLPolicy, sft_step

    rows = collate(_rollouts(tok), EOT)
    acc = Accelerator(cpu=True)
    results = []
    for batches in ([rows], [collate([r], EOT) for r in _rollouts(tok)]):
        policy = NLLPolicy(_tiny_model(1))
        opt = torch.optim.SGD(policy.parameters(), lr=1.0)
        before = {n: p.detach().clone() for n, p in policy.named_parameters()}
        m = sft_step(acc, policy, opt, batches, max_grad_norm=1e9)
        step = {n: before[n] - p.detach() for n, p in policy.named_parameters()}
        results.append((m, step))
    (m_one, step_one), (m_acc, step_acc) = results
    assert m_one["tokens/trained"] == m_acc["tokens/trained"] == rows.num_loss_tokens
    assert m_one["loss"] == pytest.approx(m_acc["loss"], rel=1e-12)
    for name, d in step_one.items():
        torch.testing.assert_close(step_acc[name], d, rtol=1e-9, atol=1e-12, msg=name)


# --- runs ------------------------------------------------------------------------------------


def _sft_cfg(run_dir: Path, model_dir: Path, *extra: str):
    return load_config(
        SFT_DEMO,
        [
            f'model.name_or_path="{model_dir}"',
            f'run.run_dir="{run_dir}"',
            "run.progress_bar=false",
            *extra,
        ],
    )


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_fused_adamw_takes_the_same_steps_as_the_default():
    """The learner's optimizer on a GPU without DeepSpeed is torch's fused AdamW (no
    parameter-sized temporaries). Here on CPU (where the learner keeps the default): the same
    three updates as the multi-tensor default, weight decay included."""
    from learner.config.step import OptimConfig
    from learner.run.runtime import make_accelerator, optimizer_and_schedule, use_fused_adamw

    assert not use_fused_adamw(make_accelerator())  # no GPU here
    torch.manual_seed(0)
    nets = [torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [
        optimizer_and_schedule(
            net, OptimConfig(weight_decay=0.1), lr=1e-2, schedule="constant", warmup_steps=0,
            steps=3, fused=fused,
        )[0]
        for net, fused in zip(nets, (False, True), strict=True)
    ]  # fmt: skip
    assert opts[1].defaults["fused"] and not opts[0].defaults["fused"]
    x = torch.randn(16, 8)
    for _ in range(3):
        for net, opt in zip(nets, opts, strict=True):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b_ in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    assert not torch.equal(torch.nn.Linear(8, 4).weight, nets[0].weight)  # they did move


def test_short_run_learns_and_writes_a_loadable_model(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from learner.run.metrics import read_metrics
    from learner.sft import train_sft

    run = tmp_path / "sft"
    steps = ("sft.steps=12", "sft.batch_size=4", "sft.micro_batch_size=2")
    last = train_sft(_sft_cfg(run, tiny_model_dir, *steps))
    records = read_metrics(run)
    losses = [r["loss"] for r in records]
    assert len(losses) == 12 and last["loss"] == losses[-1]
    assert losses[0] > 5.0  # ~ln(265): a random model
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.5, losses
    for key in ("throughput/train_tokens_per_s", "time/step", "lr", "grad_norm", "tokens/trained"):
        assert records[-1][key] > 0, key
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert model.config.vocab_size == 265
    assert json.loads((run / "final" / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "PreTrainedTokenizerFast"
    )


def test_lora_sft_saves_a_merged_plain_model(tmp_path, tiny_model_dir):
    from learner.sft import train_sft

    run = tmp_path / "lora"
    train_sft(_sft_cfg(run, tiny_model_dir, "sft.steps=2", "model.lora.r=4"))
    base, final = _weights(tiny_model_dir), _weights(run / "final")
    assert final.keys() == base.keys()  # no adapter tensors: GRPO loads it as a base model
    changed = [k for k in base if not torch.equal(base[k], final[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed), changed
    assert (run / "final" / "adapter" / "adapter_model.safetensors").is_file()  # and alone


def test_qlora_sft_saves_a_dense_merged_model_and_adapter_checkpoints(tmp_path, tiny_model_dir):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from learner.sft import train_sft

    run = tmp_path / "qlora"
    qlora = ("model.lora.r=4", 'model.lora.quantization="nf4"', "run.checkpoint_every=2")
    train_sft(_sft_cfg(run, tiny_model_dir, "sft.steps=2", *qlora))
    ckpt = next((run / "checkpoints").iterdir())
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file()
    assert not list(ckpt.glob("model*.safetensors"))  # no (4-bit) base weights in checkpoints
    base, final = _weights(tiny_model_dir), _weights(run / "final")
    assert final.keys() == base.keys()
    config = json.loads((run / "final" / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model for GRPO and the servers
    # final = the 4-bit base dequantized + the checkpoint's adapter merged, as PEFT loads them
    from peft import PeftModel

    from learner.model.setup import bnb_4bit
    from learner.sync.tensors import merged_lora_weights

    quantized = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, quantization_config=bnb_4bit("nf4", "float32"), dtype=torch.float32
    )
    expected = dict(merged_lora_weights(PeftModel.from_pretrained(quantized, ckpt / "adapter")))
    assert expected.keys() == base.keys()
    for k in base:
        assert final[k].dtype == base[k].dtype, k
        torch.testing.assert_close(final[k], expected[k], msg=k)
    assert any(not torch.equal(final[k], base[k]) for k in base)
    AutoModelForCausalLM.from_pretrained(run / "final")  # loads without bitsandbytes settings
    train_sft(_sft_cfg(run, tiny_model_dir, "sft.steps=3", *qlora), resume=True)


def test_sigterm_then_resume_continues_exactly(tmp_path, tiny_model_dir, caplog, monkeypatch):
    """SIGTERM during step 2 (a preemption) ends that step, checkpoints it (no periodic
    checkpoint is due) and stops; the resume ends where an uninterrupted run does."""
    import learner.sft
    from learner.run.metrics import read_metrics
    from learner.run.runtime import TrainingStopped
    from learner.sft import train_sft

    common = ("run.checkpoint_every=3", "sft.batch_size=4", "sft.micro_batch_size=2")
    whole, split = tmp_path / "whole", tmp_path / "split"
    train_sft(_sft_cfg(whole, tiny_model_dir, "sft.steps=6", *common))
    real_step, calls = learner.sft.sft_step, []

    def step_then_sigterm_at_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # a real SIGTERM to this process, mid-step
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(learner.sft, "sft_step", step_then_sigterm_at_2)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingStopped, match="after step 2 of 6"):
        train_sft(_sft_cfg(split, tiny_model_dir, "sft.steps=6", *common))
    monkeypatch.setattr(learner.sft, "sft_step", real_step)
    assert (split / "checkpoints" / "step_000002").is_dir() and not (split / "final").exists()
    assert signal.getsignal(signal.SIGTERM) is handler  # the one before is put back
    train_sft(_sft_cfg(split, tiny_model_dir, "sft.steps=6", *common), resume=True)
    assert [r["step"] for r in read_metrics(split)] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in read_metrics(split)] == [r["loss"] for r in read_metrics(whole)]
    a, c = _weights(whole / "final"), _weights(split / "final")
    assert a.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], c[k]), k

    # a damaged last checkpoint: the resume falls back to the one before and redoes 4-6
    (split / "checkpoints" / "step_000006" / "optimizer.bin").unlink()
    train_sft(_sft_cfg(split, tiny_model_dir, "sft.steps=6", *common), resume=True)
    assert "checkpoint step_000006 cannot be loaded" in caplog.text
    assert "trying step_000003" in caplog.text
    raw = [json.loads(line)["step"] for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert raw == [1, 2, 3, 4, 5, 6]
    c = _weights(split / "final")
    for k in a:
        assert torch.equal(a[k], c[k]), k


def test_two_processes_match_one(tmp_path, tiny_model_dir):
    """DDP (accelerate launch, gloo on CPU): each rank takes half of every step's rows; the loss
    weighting over all ranks' targets makes the run equal to one process's."""
    import os
    import subprocess

    from learner.run.metrics import read_metrics
    from learner.sft import train_sft

    common = ("sft.steps=3", "sft.batch_size=4", "sft.micro_batch_size=2")
    one, two = tmp_path / "one", tmp_path / "two"
    train_sft(_sft_cfg(one, tiny_model_dir, *common))
    sets = [f'model.name_or_path="{tiny_model_dir}"', "run.progress_bar=false", *common]
    cmd = [*cpu_launch(2), "-m", "learner", "sft", "--config", str(SFT_DEMO), "--run-dir", str(two)]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, c = read_metrics(one), read_metrics(two)
    assert [r["tokens/trained"] for r in a] == [r["tokens/trained"] for r in c]
    assert [r["loss"] for r in c] == pytest.approx([r["loss"] for r in a], rel=1e-5)
    wa, wc = _weights(one / "final"), _weights(two / "final")
    for k in wa:
        torch.testing.assert_close(wc[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)


def test_warm_start_then_grpo_from_the_sft_weights(tmp_path, tiny_model_dir, start_server):
    """GRPO after SFT starts from RUN_DIR/sft/final, and an external server receives it by a
    weight sync before the first generation (samples of step 1 have weight version 1)."""
    from learner.run.metrics import read_metrics
    from learner.trainer import train
    from rollout_server.settings import ServerSettings

    run = tmp_path / "run"
    with start_server(ServerSettings(model=str(tiny_model_dir))) as server:
        cfg = load_config(
            DEMO,
            [
                f'model.name_or_path="{tiny_model_dir}"',
                f'run.run_dir="{run}"',
                f'rollout.servers=["{server.url}"]',
                f'sft.data="{ROOT / "learner" / "data" / "sft_demo.jsonl"}"',
                "sft.steps=3",
                "sft.lr=3e-3",
                "run.steps=1",
                "run.progress_bar=false",
                "run.tensorboard=false",
                "grpo.prompts_per_step=2",
                "sampling.num_generations=2",
                "sampling.max_tokens=4",
                "optim.lr=1e-12",  # GRPO barely moves: its final weights are the SFT's
            ],
        )
        train(cfg)
    assert len(read_metrics(run / "sft")) == 3
    (record,) = read_metrics(run)
    assert record["weight_version/min"] == 1
    base, sft, final = (_weights(p) for p in (tiny_model_dir, run / "sft" / "final", run / "final"))
    assert any(not torch.allclose(base[k], sft[k], atol=1e-4) for k in sft)
    for k in sft:
        torch.testing.assert_close(final[k], sft[k], rtol=0, atol=1e-8, msg=k)


# --- config ----------------------------------------------------------------------------------


def test_shipped_sft_config_parses_and_resolves_its_data():
    cfg = load_config(SFT_DEMO)
    assert cfg.sft is not None and cfg.has_grpo  # SFT alone, or a warm start before GRPO
    assert Path(cfg.sft.data).is_absolute() and Path(cfg.sft.data).is_file()
    rows, fmt = load_sft_rows(cfg.sft)
    assert fmt == "messages" and len(rows) >= 32


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sft.epochs=2", "give sft.steps or sft.epochs, not both"),
        ("sft.lrr=1e-5", "sft.lrr: unknown field"),
        ("sft.micro_batch_size=0", "sft.micro_batch_size"),
        ("sft.max_length=1", "sft.max_length"),
    ],
)
def test_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(SFT_DEMO, [override])


def test_sft_only_config_is_valid_but_not_for_grpo(tmp_path, capsys):
    from learner.cli import main

    path = tmp_path / "sft_only.toml"
    path.write_text(f'[sft]\ndata = "{ROOT / "learner" / "data" / "sft_demo.jsonl"}"\n')
    cfg = load_config(path)
    assert cfg.sft is not None and not cfg.has_grpo
    assert main(["--config", str(path)]) == 2
    assert "python -m learner sft --config" in capsys.readouterr().err
    path.write_text("[run]\nsteps = 3\n")  # neither SFT nor GRPO data: the GRPO error stands
    with pytest.raises(ConfigError, match=r"give either \[data\]"):
        load_config(path)


def test_cli_sft_needs_an_sft_section(capsys):
    from learner.cli import main

    assert main(["sft", "--config", str(DEMO)]) == 2
    assert "has no [sft] section" in capsys.readouterr().err
