"""Routing replay against a real transformers-engine server: the learner's log-probs of the
sampled tokens with and without the server's recorded experts."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from grpo_common.moe import find_routers
from learner.config import ConfigError, load_config
from learner.model.policy import PolicyLogprobs
from learner.model.routing import replay_routes
from learner.step.batch import Rollout, collate
from learner.step.packing import pack
from learner.step.rollouts import generate_request
from rollout_server.client import RolloutClient
from rollout_server.protocol import GenerateRequest
from rollout_server.settings import ServerSettings
from rollout_server.tiny import save_tiny_model

DEMO = Path(__file__).parents[3] / "learner/configs/demo.toml"
PROMPTS = ["the vowel song: ", "aeiou", "sing it again, and then", "x"]


@pytest.fixture(scope="module", params=["qwen3_moe", "olmoe"])
def moe_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """Weights 5x the default's spread (an expert's output moves the log-probs visibly), but
    routers 20x narrower: nearly uniform routing, where near-ties abound. Qwen3-MoE
    renormalises its top-k gate weights, OLMoE does not."""
    path = save_tiny_model(
        tmp_path_factory.mktemp(request.param), moe=request.param, seed=3, initializer_range=0.1
    )
    weights = load_file(path / "model.safetensors")
    for name in weights:
        if name.endswith(".mlp.gate.weight"):
            weights[name] = weights[name] * 0.05
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def served(moe_dir: Path, start_server) -> list[Rollout]:
    """Rollouts the server sampled (4 prompts x 2, 12 tokens), with their routes."""
    request = GenerateRequest(prompts=PROMPTS, n=2, max_tokens=12, seed=7, ignore_eos=True,
                              return_routed_experts=True)  # fmt: skip

    async def go():
        async with RolloutClient(server.url, max_retries=0) as client:
            return await client.generate(request)

    with start_server(ServerSettings(model=str(moe_dir))) as server:
        resp = asyncio.run(go())
    return [
        Rollout(
            r.prompt_token_ids,
            s.token_ids,
            s.logprobs,
            [1] * len(s.token_ids),
            routes=s.routed_experts.decode(),
        )
        for r in resp.results
        for s in r.samples
    ]


def _learner_logprobs(model, rollouts: list[Rollout], replay: bool, packed: bool = False):
    batch = pack(rollouts) if packed else collate(rollouts, pad_id=0)
    policy = PolicyLogprobs(model)
    with torch.no_grad():
        lp, _ = policy(
            batch.input_ids,
            batch.block_causal_mask() if packed else batch.attention_mask,
            batch.loss_mask,
            getattr(batch, "position_ids", None),
            routes=batch.routes if replay else None,
        )
    server = batch.sampling_logprobs[batch.loss_mask.bool()]
    return lp, server


def _router_io(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each router's (input hidden states, chosen experts) in a plain forward of ``ids``."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(i: int):
        return lambda m, args, out: seen.__setitem__(i, (args[0], out[2]))

    hooks = [m.register_forward_hook(keep(i)) for i, m in enumerate(find_routers(model))]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return [seen[i] for i in sorted(seen)]


def _own_routes(model, rollouts: list[Rollout]) -> list[np.ndarray]:
    """The experts the learner's model picks itself for each rollout's routed tokens."""
    out = []
    for r in rollouts:
        io = _router_io(model, (r.prompt_ids + r.completion_ids)[:-1])
        out.append(torch.stack([chosen for _, chosen in io], 1).numpy())
    return out


def test_routes_cover_every_token_the_server_ran(served: list[Rollout]) -> None:
    for r in served:
        assert r.routes.shape == (len(r.prompt_ids) + len(r.completion_ids) - 1, 2, 2)
        assert r.routes.min() >= 0 and r.routes.max() < 8
        assert (r.routes[:, :, 0] != r.routes[:, :, 1]).all()  # top-2: two distinct experts


@pytest.mark.parametrize("packed", [False, True])
def test_with_the_same_weights_replayed_log_probs_equal_the_server_s(
    moe_dir: Path, served: list[Rollout], packed: bool
) -> None:
    model = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    lp, server = _learner_logprobs(model, served, replay=True, packed=packed)
    assert lp.shape == server.shape == (len(served) * 12,)
    torch.testing.assert_close(lp, server, atol=2e-5, rtol=0)


def _flip_the_nearest_tie(model, rollouts: list[Rollout]) -> tuple[int, int]:
    """Raise, in one router, the logit of the best expert left out of the top-k of the
    routed token where it comes closest, just past the weakest one kept, for that token's
    hidden state: its routing flips; that expert's logit for any other token moves by 1.5
    times that smallest gap at most (times their hidden states' cosine and norm ratio).
    Returns (rollout, token) of the flip."""
    routers = find_routers(model)
    k = routers[0].top_k
    best = None
    for n, r in enumerate(rollouts):
        io = _router_io(model, (r.prompt_ids + r.completion_ids)[:-1])
        for layer, (hidden, _) in enumerate(io):
            hidden = hidden.reshape(-1, hidden.shape[-1])
            top = (hidden @ routers[layer].weight.detach().T).topk(k + 1, dim=-1)
            gaps = top.values[:, k - 1] - top.values[:, k]
            gaps[: len(r.prompt_ids)] = torch.inf  # a completion token: one rollout flips
            t = int(gaps.argmin())
            if best is None or gaps[t] < best[0]:
                best = (float(gaps[t]), n, t, layer, hidden[t], int(top.indices[t, k]))
    assert best is not None
    gap, n, t, layer, hidden, left_out = best
    with torch.no_grad():
        routers[layer].weight[left_out] += 1.5 * gap * hidden / hidden.dot(hidden)
    print(f"the nearest tie: {gap:.2e} (rollout {n}, token {t}, layer {layer})")
    return n, t


def test_replay_keeps_the_log_probs_where_routing_flips(
    moe_dir: Path, served: list[Rollout]
) -> None:
    """The learner's router differs from the sampler's by a hair that flips one near-tied
    token's top-2 (a step's update, or another kernel's rounding, does that): without replay
    that token and those after it route elsewhere and their log-probs jump; with replay the
    recorded experts run, and the log-probs stay the server's."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    n, t = _flip_the_nearest_tie(model, served)
    own = _own_routes(model, served)
    flips = [np.argwhere((o != r.routes).any(-1)) for o, r in zip(own, served, strict=True)]
    assert [len(f) for f in flips] == [int(i == n) for i in range(len(served))]
    assert flips[n][0][0] == t
    off, server = _learner_logprobs(model, served, replay=False)
    on, _ = _learner_logprobs(model, served, replay=True)
    gap_off, gap_on = (off - server).abs(), (on - server).abs()
    print(f"without replay: max gap {gap_off.max():.2e}, with: {gap_on.max():.2e}")
    torch.testing.assert_close(on, server, atol=1e-4, rtol=0)
    assert gap_off.max() > 1e-2


def test_replay_refuses_routes_of_another_shape(moe_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    ids = torch.tensor([[1, 2, 3]])
    routes = torch.zeros((1, 3, 3, 2), dtype=torch.int16)  # 3 layers; the model has 2
    refused = pytest.raises(ValueError, match="3 MoE layers, the model 2 routers")
    with refused, replay_routes(model.get_decoder(), routes):
        model(input_ids=ids)
    assert "forward" not in vars(find_routers(model)[0])  # nothing stays patched


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["model.gradient_checkpointing=true"], "gradient checkpointing recomputes"),
        (["model.compile=true"], "compiled decoder layers"),
        (["rollout.embedded.engine=vllm"], "needs the transformers engine here"),
        (
            ['rollout.servers=["http://h:1"]', "rollout.server_api=vllm", "rollout.sync.type=vllm"],
            "transformers engine",
        ),
    ],
)
def test_routing_replay_refuses_what_cannot_replay(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["model.routing_replay=r3", *overrides])
    assert "model.routing_replay = 'r3'" in str(err.value)
    assert fragment in str(err.value)
    load_config(DEMO, ["model.routing_replay=off", *overrides[:1]])  # without replay: fine


def test_the_request_asks_for_routes_only_with_replay() -> None:
    assert generate_request(
        load_config(DEMO, ["model.routing_replay=r3"]), ["a"]
    ).return_routed_experts
    assert not generate_request(load_config(DEMO), ["a"]).return_routed_experts


def test_r2_later_passes_route_as_the_old_policy_pass(moe_dir: Path, served: list[Rollout]) -> None:
    """r2 with two passes: the old-policy pass records the learner's own routes into the
    batches; after the update (here: a router flipped by a hair) the second pass's log-probs
    stay the old pass's, as its tokens keep their experts."""
    from accelerate import Accelerator

    from learner.loss.grpo import LossConfig
    from learner.step.update import StepOptions, build_micro_batches, policy_forward, prepare_step

    cfg = load_config(DEMO, ["model.routing_replay=r2", "grpo.num_iterations=2"])
    own = [dataclasses.replace(r, routes=None, advantage=1.0) for r in served]
    model = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    policy = PolicyLogprobs(model)
    opts = StepOptions.of(cfg)
    step = build_micro_batches(own, opts, LossConfig.of(cfg.grpo, 12), pad_id=0)
    prep = prepare_step(Accelerator(cpu=True), policy, None, step, opts)
    (batch,) = prep.batches
    assert batch.routes is not None and batch.routes.shape[2:] == (2, 2)
    (old,) = prep.olds
    _flip_the_nearest_tie(model, served)
    with torch.no_grad():
        replayed = prep.group(0, policy_forward(policy, batch)[0])
        plain = prep.group(0, policy_forward(policy, dataclasses.replace(batch, routes=None))[0])
    torch.testing.assert_close(replayed, old, atol=1e-4, rtol=0)
    assert (plain - old).abs().max() > 1e-2


def test_r2_needs_a_second_pass() -> None:
    with pytest.raises(ConfigError, match="r2 replays the old-policy pass's routes"):
        load_config(DEMO, ["model.routing_replay=r2"])
