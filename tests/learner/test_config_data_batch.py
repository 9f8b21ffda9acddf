"""Config parsing, the data stream and batch alignment (pure parts of the learner)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from learner.config import ConfigError, load_config
from learner.data.prompts import DataError, PromptFormat, PromptStream, load_rows
from learner.step.batch import Rollout, collate, micro_batches

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "learner" / "configs").glob("*.toml"))


def test_configs_are_shipped():
    assert SHIPPED, "learner/configs/ holds no configs"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_parses(path, tmp_path):
    cfg = load_config(path)
    if cfg.data is not None and cfg.data.path == "openai/gsm8k":  # from the Hub: check it on
        gsm8k_config_reads_gsm8k_and_grades_it(cfg, tmp_path)  # a copy of GSM8K's layout
        return
    if cfg.environment is not None:
        from rewards.registry import load_environment

        load_environment(cfg.environment.name)  # registered (raises naming the known ones)
        return
    assert cfg.rewards and cfg.data is not None
    from rewards.registry import load_reward

    for r in cfg.rewards:
        load_reward(r.name)
    assert Path(cfg.data.path).exists(), f"{path.name}: data.path {cfg.data.path} missing"


def gsm8k_config_reads_gsm8k_and_grades_it(cfg, tmp_path: Path) -> None:
    """learner/configs/gsm8k.toml on a local dataset laid out as openai/gsm8k on the Hub (its
    subsets, splits and columns): the prompts it builds and the reward's grades."""
    from rewards.registry import load_reward

    solved = {"question": "What is 6 times 7?", "answer": "6 * 7 = <<6*7=42>>42\n#### 42"}
    held_out = {"question": "What is 2 plus 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}
    hub = write_hub_layout(tmp_path / "gsm8k", {"train": [solved], "test": [held_out]})
    d = cfg.data
    rows = load_rows(hub, d.prompt_column, split=d.split, subset=d.subset,
                     prompt_format=PromptFormat.of(d))  # fmt: skip
    system, user = rows[0]["prompt"]
    assert system == {"role": "system", "content": d.system_prompt}
    assert user["role"] == "user" and user["content"].startswith("What is 6 times 7?\nThink")
    assert cfg.eval is not None and cfg.eval.data == d.path and cfg.eval.subset is None
    test = load_rows(hub, "prompt", split=cfg.eval.split, subset=d.subset,
                     prompt_format=PromptFormat.of(d))  # fmt: skip
    assert test[0]["question"] == held_out["question"]
    [reward] = cfg.rewards
    fn = load_reward(reward.name)
    completions = ["6 * 7 is 42.\n#### 42", "It is 6 + 7 = 13.\n#### 13"]
    prompts = [rows[0]["prompt"]] * 2
    assert fn(prompts, completions, answer=[solved["answer"]] * 2) == [1.0, 0.0]


def test_override_parses_toml_values_and_strings():
    cfg = load_config(
        SHIPPED[0],
        [
            "optim.lr=0.5",
            "run.run_dir=elsewhere",
            'rollout.servers=["http://a:1"]',
            "grpo.beta=0.1",
        ],
    )
    assert cfg.optim.lr == 0.5
    assert cfg.run.run_dir == "elsewhere"
    assert cfg.rollout.servers == ["http://a:1"]
    assert cfg.grpo.beta == 0.1


def test_none_unsets_a_field_that_may_be_unset():
    """TOML has no null: the word none (or null) unsets optional fields, and only those."""
    demo = ROOT / "learner" / "configs" / "demo.toml"
    cfg = load_config(
        demo,
        [
            "grpo.tis_cap=none",
            "rollout.sleep_while_training=Null",
            "rollout.api_key=none",  # a string field keeps the word
            'model.lora={r = 4, quantization = "none"}',  # and so does a Literal's "none"
        ],
    )
    assert cfg.grpo.tis_cap is None and cfg.rollout.sleep_while_training is None
    assert cfg.rollout.api_key == "none"
    assert cfg.model.lora is not None and cfg.model.lora.quantization == "none"
    assert load_config(demo).grpo.tis_cap == 2.0
    calc = load_config(ROOT / "learner" / "configs" / "calculator.toml")
    assert calc.environment is not None and calc.environment.episode_timeout_s == 300.0
    calc = load_config(
        ROOT / "learner" / "configs" / "calculator.toml", ['environment.episode_timeout_s="none"']
    )
    assert calc.environment is not None and calc.environment.episode_timeout_s is None
    with pytest.raises(ConfigError, match=r"grpo\.tis_cap"):
        load_config(demo, ["grpo.tis_cap=off"])


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("grpo.loss_typ=dapo", "grpo.loss_typ: unknown field"),
        ("grpo.loss_type=ppo", "grpo.loss_type"),
        ("sampling.num_generations=1", "sampling.num_generations"),
        ("rollout.sync=file", "rollout.sync.dir"),
        ("optim.lr=-1", "optim.lr"),
        ("nonsense", "section.field=value"),
        ("scoring.timeout_s=inf", "scoring.timeout_s: Input should be a finite number"),
        ("optim.lr=nan", "optim.lr: Input should be a finite number"),
        ("sampling.min_p=2", "sampling.min_p: Input should be less than or equal to 1"),
        ("sampling.top_k=-5", "sampling.top_k"),
        ("sampling.repetition_penalty=0", "sampling.repetition_penalty"),
        # the rollout server's floors: a config it would refuse fails at load, not at step 1
        ("sampling.top_p=1e-9", "sampling.top_p: Input should be greater than or equal to"),
        ("sampling.temperature=1e-4", "sampling.temperature"),
        ("sampling.repetition_penalty=1e-3", "sampling.repetition_penalty"),
        ("run.steps=true", "run.steps: give a number, not true"),
        ("grpo.tis_cap=false", "grpo.tis_cap: give a number, not false"),
    ],
)
def test_bad_config_names_the_field(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(SHIPPED[0], [override])
    assert fragment in str(e.value)


def test_missing_required_section(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[grpo]\nbeta = 0.0\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "give either [data] and at least one [[rewards]], or an [environment]" in str(e.value)


def test_environment_excludes_data_and_rewards(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[environment]\nname = "calculator"\n')
    assert load_config(p).environment.max_turns == 4
    p.write_text('environment = "openreward:http://127.0.0.1:8080"\n')  # the one-line form
    env = load_config(p).environment
    assert (env.name, env.max_turns) == ("openreward:http://127.0.0.1:8080", 4)
    p.write_text('[environment]\nname = "calculator"\n[[rewards]]\nname = "format"\n')
    with pytest.raises(ConfigError, match=r"remove \[data\] and \[\[rewards\]\]"):
        load_config(p)


def test_a_top_level_key_under_a_section_says_where_it_belongs(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[model]\nname_or_path = "tiny"\nenvironment = "calculator"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert (
        "  model.environment: 'environment' is a top-level key, not a field of [model]: put it "
        "above the first [section] of the file (a TOML key belongs to the [section] above it)"
    ) in str(e.value).splitlines()


def test_the_one_line_environment_takes_field_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('environment = "calculator"\n')
    env = load_config(p, ["environment.split=test", "environment.max_turns=2"]).environment
    assert (env.name, env.split, env.max_turns) == ("calculator", "test", 2)


def test_one_reward_twice_needs_a_label_and_the_label_reaches_the_runner():
    from learner.config import RewardConfig
    from rewards.scoring import RewardSpec

    twice = 'rewards=[{name="charset"}, {name="charset", weight=0.5}]'
    with pytest.raises(
        ConfigError,
        match=r"\[\[rewards\]\] \['charset'\] appear more than once: give each a distinct `label`",
    ):
        load_config(ROOT / "learner" / "configs" / "demo.toml", [twice])
    labelled = 'rewards=[{name="charset"}, {name="charset", weight=0.5, label="half"}]'
    cfg = load_config(ROOT / "learner" / "configs" / "demo.toml", [labelled])
    assert [RewardSpec(**r.model_dump()).key for r in cfg.rewards] == ["charset", "half"]
    assert set(RewardConfig.model_fields) == set(RewardSpec.model_fields)  # the trainer's copy


def test_data_jsonl_errors_name_the_problem(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"question": "x"}\n')
    with pytest.raises(DataError, match="no 'prompt' column"):
        load_rows(p, "prompt")
    p.write_text("{not json\n")
    with pytest.raises(DataError, match=":1 is not valid JSON"):
        load_rows(p, "prompt")
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl", "prompt")
    good = '{"prompt": "hi"}\n{"prompt": [{"role": "user", "content": "hi"}]}\n'
    for bad, message in [
        ('{"prompt": ""}', "row 2: 'prompt' is empty text"),
        ('{"prompt": []}', "row 2: 'prompt' is an empty list of messages"),
        ('{"prompt": [{"role": "human", "content": "x"}]}', "row 2: 'prompt', message 0: role:"),
        ('{"prompt": [{"content": "x"}]}', "message 0: role: Field required"),
    ]:
        p.write_text(good + bad + "\n")
        with pytest.raises(DataError, match=re.escape(message)):
            load_rows(p, "prompt")
    p.write_text(good + '{"prompt": ""}\n')
    assert len(load_rows(p, "prompt", allow_empty=True)) == 3  # SFT: completion-only rows


def write_hub_layout(root: Path, splits: dict[str, list[dict]]) -> Path:
    """A dataset directory laid out as a Hub repository: two subsets (configs), ``main`` with
    ``splits`` and ``other`` with one row, Parquet files declared in the README's metadata (what
    ``load_dataset("owner/name", subset, split=...)`` reads after the download)."""
    import datasets

    meta = ["---", "configs:"]
    for subset, parts in (("main", splits), ("other", {"train": [{"prompt": "other"}]})):
        meta += [f"- config_name: {subset}", "  data_files:"]
        for split, rows in parts.items():
            (root / subset).mkdir(parents=True, exist_ok=True)
            datasets.Dataset.from_list(rows).to_parquet(str(root / subset / f"{split}.parquet"))
            meta += [f"  - split: {split}", f"    path: {subset}/{split}.parquet"]
    (root / "README.md").write_text("\n".join([*meta, "---", ""]))
    return root


def test_data_reads_files_datasets_directories_and_hub_layouts(tmp_path):
    import datasets

    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(tmp_path / "ds", "prompt") == rows
    ds = datasets.Dataset.from_list(rows)
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "dd"))
    assert load_rows(tmp_path / "dd", "prompt", split="test") == rows[1:]
    with pytest.raises(
        DataError, match=r"holds splits \['train', 'test'\], not 'dev': set data\.split"
    ):
        load_rows(tmp_path / "dd", "prompt", split="dev")
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    (tmp_path / "d.json").write_text(json.dumps(rows))  # a JSON array, not JSON lines
    for name in ("d.parquet", "d.csv", "d.json"):  # one file: its split and subset are moot
        got = load_rows(tmp_path / name, "prompt", split="test", subset="main")
        assert [(r["prompt"], str(r["answer"])) for r in got] == [("a", "1"), ("b", "2")], name
    hub = write_hub_layout(tmp_path / "hub", {"train": rows, "test": rows[:1]})
    assert load_rows(hub, "prompt", subset="main") == rows
    assert load_rows(hub, "prompt", subset="main", split="test") == rows[:1]
    assert load_rows(hub, "prompt", subset="other") == [{"prompt": "other"}]
    # another directory of the same name: its own rows (datasets' cache would serve the first's)
    again = write_hub_layout(tmp_path / "b" / "hub", {"train": rows[::-1], "test": rows[:1]})
    assert load_rows(again, "prompt", subset="main") == rows[::-1]
    for kwargs, message in [
        ({}, "Config name is missing. Please pick one among the available configs: "
             "['main', 'other'] Set data.subset"),
        ({"subset": "mian"}, "'mian' not found. Available: ['main', 'other'] Set data.subset"),
        ({"subset": "main", "split": "dev"}, 'Unknown split "dev". Should be one of '
             "['train', 'test']. Set data.split"),
    ]:  # fmt: skip
        with pytest.raises(
            DataError, match=re.escape(f"data.path {hub}: ") + ".*" + re.escape(message)
        ):
            load_rows(hub, "prompt", **kwargs)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"data\.path .*empty\.jsonl holds no rows"):
        load_rows(tmp_path / "empty.jsonl", "prompt")


def test_a_hub_id_is_loaded_from_the_hub_and_its_failure_names_the_fix(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no cached copy to fall back on
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        load_rows("openai/gsm8k", "prompt", subset="main")
    assert str(e.value).startswith(
        "data.path openai/gsm8k is not a local file or directory (looked at "
        f"{tmp_path / 'openai' / 'gsm8k'}) and could not be loaded from the Hugging Face Hub "
        "(ConnectionError: Couldn't reach 'openai/gsm8k' on the Hub"
    )
    assert "HF_HUB_OFFLINE unset" in str(e.value)
    # a path with a data file's suffix is a missing file, never a Hub id
    with pytest.raises(DataError, match=r"data\.path data/train\.jsonl does not exist"):
        load_rows("data/train.jsonl", "prompt")


def test_prompt_template_and_system_prompt_build_the_prompts(tmp_path):
    rows = [{"question": "2+2?", "answer": "#### 4", "n": 3}]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def built(template=None, system=None, chat=True, path=p):
        got = load_rows(path, "prompt", prompt_format=PromptFormat(template, system, chat))
        return got[0]["prompt"]

    assert built("Q{n}: {question}") == [{"role": "user", "content": "Q3: 2+2?"}]
    assert built("Q: {question} \\boxed{{}}", chat=False) == "Q: 2+2? \\boxed{}"
    assert built("{question}", "Think.") == [
        {"role": "system", "content": "Think."},
        {"role": "user", "content": "2+2?"},
    ]
    with pytest.raises(DataError, match=r"row 0 has no 'questoin' column, which data\.prompt_"):
        built("{questoin}")
    text = tmp_path / "text.jsonl"  # no template: the prompt column gets the system prompt
    text.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert built(system="Be brief.", path=text)[0] == {"role": "system", "content": "Be brief."}
    chat = tmp_path / "chat.jsonl"
    message = {"role": "system", "content": "own"}
    chat.write_text(json.dumps({"prompt": [message, {"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"already starts with a system message; unset data\.sys"):
        built(system="Be brief.", path=chat)
    base = ['data.path="d.jsonl"', 'rewards=[{name="charset"}]']
    for override, message in [
        ('data.prompt_template="Answer in \\\\boxed{}: {question}"', "data.prompt_template: {} names no column"),
        ('data.prompt_template="{question"', "data.prompt_template: expected '}' before end"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, [*base, override])
    with pytest.raises(ConfigError, match=r"data\.system_prompt: plain-text prompts \(chat = f"):
        load_config(None, [*base, 'data.system_prompt="x"', "data.chat=false"])
    load_config(None, [*base, 'data.system_prompt="x"', 'data.prompt_template="{question}"'])


def test_stream_is_seeded_epochal_and_resumable():
    rows = [{"prompt": str(i)} for i in range(5)]
    a = PromptStream(rows, seed=3, shuffle=True)
    seen = [r["prompt"] for r in a.take(10)]
    assert sorted(seen[:5]) == sorted(seen[5:]) == [str(i) for i in range(5)]  # two full epochs
    assert seen[:5] != seen[5:]  # reshuffled per epoch (fixed for seed 3)
    b = PromptStream(rows, seed=3, shuffle=True)
    b.take(7)
    c = PromptStream(rows, seed=3, shuffle=True)
    c.load_state_dict(b.state_dict())
    assert [r["prompt"] for r in c.take(3)] == seen[7:10]
    with pytest.raises(DataError, match=r"data\.seed"):
        PromptStream(rows, seed=4, shuffle=True).load_state_dict(b.state_dict())


def test_a_resume_on_changed_data_says_so(caplog):
    rows = [{"prompt": str(i)} for i in range(5)]
    old = PromptStream(rows, seed=3, shuffle=True)
    old.take(4)
    with caplog.at_level("WARNING", logger="learner.data.prompts"):
        PromptStream(list(rows), seed=3, shuffle=True).load_state_dict(old.state_dict())
        assert not caplog.records  # the same rows: nothing to say
        edited = [*rows[:2], {"prompt": "2, fixed"}, *rows[3:], {"prompt": "5"}]
        PromptStream(edited, seed=3, shuffle=True).load_state_dict(old.state_dict())
    (record,) = caplog.records
    assert "data changed since the checkpoint (5 rows then, 6 now" in record.getMessage()


def test_collate_aligns_targets_by_hand():
    # prompt [5, 6] + completion [7, 8, 9] with tool token 8 masked out.
    r = Rollout([5, 6], [7, 8, 9], [-0.1, 0.0, -0.3], [1, 0, 1], advantage=1.5)
    s = Rollout([5], [4], [-0.2], [1], advantage=-1.0)
    b = collate([r, s], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # target t predicts input t+1: 7 is predicted at t=1, 8 at t=2 (masked), 9 at t=3
    assert b.loss_mask.tolist() == [[0, 1, 0, 1], [1, 0, 0, 0]]
    assert torch.allclose(b.sampling_logprobs, torch.tensor([[0, -0.1, 0, -0.3], [-0.2, 0, 0, 0]]))
    assert b.advantages.tolist() == [1.5, -1.0]
    assert b.num_loss_tokens == 3
    assert collate([r], pad_id=0, pad_to_multiple_of=8).input_ids.shape == (1, 8)


def test_collate_rejects_ragged_rollout():
    with pytest.raises(ValueError, match="differ in length"):
        collate([Rollout([1], [2, 3], [0.0], [1, 1])], pad_id=0)


def test_micro_batches_cover_everything_once():
    rs = [Rollout([1], [2] * n, [0.0] * n, [1] * n) for n in (3, 1, 4, 1, 5)]
    mbs = micro_batches(rs, 2)
    assert [len(m) for m in mbs] == [2, 2, 1]
    assert sorted(len(r.completion_ids) for m in mbs for r in m) == [1, 1, 3, 4, 5]


def test_demo_reward_by_hand():
    from learner.data.demo_task import charset_reward

    assert charset_reward(
        [None] * 4, ["aeb", "", "zz", "x"], ["aeiou", "aeiou", "aeiou", None]
    ) == [
        pytest.approx(2 / 3),
        0.0,
        0.0,
        None,
    ]
    rows = [
        json.loads(line) for line in (ROOT / "learner/data/demo.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 64 and all(r["allowed"] == "aeiou" for r in rows)
