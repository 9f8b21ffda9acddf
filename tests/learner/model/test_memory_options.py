"""The learner's memory and throughput options on CPU: LoRA, packing, checkpointing/offloading,
MFU, truncation.

Each option must be a pure memory/throughput trade: the same loss and gradients as the plain path
(packing, checkpointing, offloading), or exactly the documented behaviour (LoRA trains only the
adapters and its reference is the base model).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.config import load_config
from learner.model.offload import ActivationOffload
from learner.model.policy import PolicyLogprobs
from learner.model.setup import build_models
from learner.run.perf import train_flops_per_token
from learner.step.batch import collate
from learner.step.packing import best_fit_decreasing, pack
from learner.step.update import policy_forward
from learner.sync.tensors import merged_lora_weights, sync_specs
from tests.learner.model.policy_checks import assert_only_adapters_train, policy_loss
from tests.learner.rollout_data import random_rollouts


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _assert_same(a, b, atol=1e-5):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, atol=atol, rtol=1e-5)
    assert ga.keys() == gb.keys()
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], atol=atol, rtol=1e-4, msg=k)


def test_best_fit_decreasing_by_hand():
    # lengths 7,5,4,3,1 into budget 8: 7->A(1 left), 5->B(3), 4->C(4), 3->B (best fit: 3 left
    # beats 4 left) , 1->A (1 left is the tightest)
    assert best_fit_decreasing([3, 7, 1, 5, 4], 8) == [[1, 2], [3, 0], [4]]
    assert best_fit_decreasing([10], 4) == [[0]]  # too long for any bin: its own bin


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_packed_and_padded_give_the_same_loss_and_gradients(model, loss_type):
    rs = random_rollouts()
    policy = PolicyLogprobs(model)
    padded = _grads(model, lambda: policy_loss(policy, collate(rs, pad_id=0), loss_type))
    packed = _grads(model, lambda: policy_loss(policy, pack(rs), loss_type))
    _assert_same(padded, packed)
    assert pack(rs).input_ids.numel() < collate(rs, pad_id=0).input_ids.numel()


def test_checkpointing_and_offloading_give_the_same_gradients(tiny_model_dir):
    rs = random_rollouts(seed=1)
    batch = collate(rs, pad_id=0)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    m.train()
    policy = PolicyLogprobs(m)
    plain = _grads(m, lambda: policy_loss(policy, batch))
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt = _grads(m, lambda: policy_loss(policy, batch))
    _assert_same(plain, ckpt)
    m.gradient_checkpointing_disable()
    offload = ActivationOffload(min_bytes=0)  # offload every saved tensor
    packed_calls = []
    orig = offload._pack

    def counting(t):
        packed_calls.append(t.shape)
        return orig(t)

    offload._pack = counting

    def with_offload():
        with offload():
            return policy_loss(policy, batch)

    _assert_same(plain, _grads(m, with_offload))
    assert len(packed_calls) > 10  # the hooks really parked the activations


def test_offloading_keeps_the_weights_in_place(tiny_model_dir):
    """A layer saves its weight for the backward; the weight stays on its device anyway, so
    copying it out and back would cost transfers for nothing: only activations leave."""
    batch = collate(random_rollouts(seed=1), pad_id=0)
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    policy = PolicyLogprobs(m)
    plain = _grads(m, lambda: policy_loss(policy, batch))
    offload = ActivationOffload(min_bytes=0, keep=m.parameters())
    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}
    kept, moved = [], []
    orig = offload._pack

    def sorting(t):
        packed = orig(t)
        (kept if packed is t else moved).append(t.untyped_storage().data_ptr() in weights)
        return packed

    offload._pack = sorting

    def with_offload():
        with offload():
            return policy_loss(policy, batch)

    _assert_same(plain, _grads(m, with_offload))
    assert any(kept) and moved and not any(moved)  # weights kept, every moved tensor is not one


class _CopyDone:
    """A stand-in for a CUDA event (none exists here): done once `finish` or `synchronize`."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")
        self.done = True


def test_offloading_bounds_the_gpu_tensors_waiting_for_their_copy():
    """The queue of GPU tensors still being copied out: finished copies are let go without a
    wait; past the byte budget the oldest copies are waited for, oldest first; at the end of
    the forward every one is let go."""
    offload = ActivationOffload(max_in_flight_bytes=100)
    log: list[str] = []
    events = {}

    def queue(name: str, nbytes: int) -> None:
        events[name] = _CopyDone(log, name)
        offload._in_flight.append((events[name], torch.empty(0), nbytes))
        offload.in_flight_bytes += nbytes
        offload._retire(offload.max_in_flight_bytes)

    queue("a", 60)
    queue("b", 30)
    assert log == [] and offload.in_flight_bytes == 90  # under budget: nobody waits
    queue("c", 30)  # 120 > 100: wait for the oldest only
    assert log == ["wait a"] and offload.in_flight_bytes == 60
    events["b"].done = True  # finished on its own: let go without a wait
    queue("d", 10)
    assert log == ["wait a"] and offload.in_flight_bytes == 40
    queue("e", 200)  # alone over the budget: everything before it, then itself
    assert log == ["wait a", "wait c", "wait d", "wait e"] and offload.in_flight_bytes == 0
    queue("f", 50)
    offload._retire(0)  # what leaving the forward's context does
    assert log[-1] == "wait f" and not offload._in_flight and offload.in_flight_bytes == 0


def test_pinned_arena_reuses_its_chunks_once_nothing_handed_out_is_alive():
    """Offloaded activations live in fixed chunks reused by the next forward: host memory is
    one micro-batch's activations, not one rounded-up block per tensor per micro-batch."""
    from learner.model.offload import PinnedArena

    arena = PinnedArena(chunk_bytes=4096, pin=False)  # pinning needs CUDA; the logic does not
    a = arena.take(torch.Size([10, 30]), torch.float32)  # 1200 bytes
    b = arena.take(torch.Size([700]), torch.bfloat16)  # 1400 bytes, at 1536 (512-aligned)
    c = arena.take(torch.Size([400]), torch.float64)  # 3200 bytes: does not fit, next chunk
    big = arena.take(torch.Size([2, 1024]), torch.float32)  # 8 KiB > a chunk: its own block
    assert len(arena.chunks) == 2 and arena.nbytes == 8192
    assert a.data_ptr() == arena.chunks[0].data_ptr()
    assert b.data_ptr() == arena.chunks[0].data_ptr() + 1536
    assert c.data_ptr() == arena.chunks[1].data_ptr()
    assert big.untyped_storage().data_ptr() not in {x.data_ptr() for x in arena.chunks}
    for x, v in ((a, 1.0), (b, 2.0), (c, 3.0)):  # no overlap: each keeps what it was given
        x.fill_(v)
    assert bool((a == 1).all() and (b == 2).all() and (c == 3).all())
    assert a.shape == (10, 30) and b.dtype == torch.bfloat16 and c.dtype == torch.float64

    del a, b, big, x  # (x: the loop's last, c)
    assert not arena.rewind()  # c is alive (a backward still to come): go on after it
    d = arena.take(torch.Size([16]), torch.float32)
    assert d.data_ptr() == c.data_ptr() + 3584  # after c, 512-aligned, not over it
    del c, d
    assert arena.rewind()
    for _ in range(3):  # the same pass again and again: the same two chunks
        e = arena.take(torch.Size([10, 30]), torch.float32)
        f = arena.take(torch.Size([400]), torch.float64)
        assert e.data_ptr() == arena.chunks[0].data_ptr() and len(arena.chunks) == 2
        del e, f
        assert arena.rewind()


def test_offloading_reuses_host_memory_across_micro_batches(tiny_model_dir):
    """The offloading hooks' forward rewinds the arena: two micro-batches (forward, backward
    each) take the host memory of one."""
    from learner.model.offload import PinnedArena

    batch = collate(random_rollouts(seed=2), pad_id=0)
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    policy = PolicyLogprobs(m)
    arena = PinnedArena(chunk_bytes=1 << 20, pin=False)
    offload = ActivationOffload(min_bytes=0, keep=m.parameters(), arena=arena)
    taken = []
    take = arena.take
    arena.take = lambda shape, dtype: taken.append(shape) or take(shape, dtype)
    chunks = []
    for _ in range(2):
        with offload():
            loss = policy_loss(policy, batch)
        loss.backward()
        del loss
        chunks.append(len(arena.chunks))
    assert taken and chunks[0] >= 1 and chunks[1] == chunks[0]


def test_lora_trains_only_adapters_and_reference_is_the_base_model(tmp_path, tiny_model_dir):
    cfg = load_config(
        None,
        [
            'data.path="x.jsonl"',
            'rewards=[{name="length"}]',
            "model.lora.r=4",
            "grpo.beta=0.1",
            "model.gradient_checkpointing=true",
        ],
    )
    policy, ref = build_models(cfg, str(tiny_model_dir))
    assert ref is None  # no second model: the reference is the adapter-less base
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = collate(random_rollouts(seed=2), pad_id=0)
    with torch.no_grad():
        ref_lp = policy_forward(policy, batch, reference=True)[0]
        base_lp = policy_forward(PolicyLogprobs(base), batch)[0]
    torch.testing.assert_close(ref_lp, base_lp, atol=1e-6, rtol=1e-6)

    assert_only_adapters_train(policy, batch)

    # The servers get merged weights under the base names: equal to peft's own merge.
    merged = dict(merged_lora_weights(policy.model))
    reference = policy.model.merge_and_unload().state_dict()
    assert set(merged) == {n for n, _ in base.named_parameters()}
    for name, t in merged.items():
        torch.testing.assert_close(t, reference[name], atol=1e-6, rtol=1e-6, msg=name)
    specs = sync_specs(policy.model, "float32")
    assert [s.name for s in specs] == list(merged)


def _lora_saved_bytes(tiny_model_dir, adapter_dtype: str) -> tuple[set, int]:
    cfg = load_config(
        None,
        ['data.path="x.jsonl"', 'rewards=[{name="length"}]', "model.lora.r=4",
         'model.dtype="bfloat16"', f'model.lora.adapter_dtype="{adapter_dtype}"',
         "model.gradient_checkpointing=false"],
    )  # fmt: skip
    policy, _ = build_models(cfg, str(tiny_model_dir))
    adapters = {p.dtype for n, p in policy.named_parameters() if "lora_" in n}
    assert {p.dtype for n, p in policy.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    saved: dict[int, int] = {}  # storage pointer -> bytes: each saved buffer counted once

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    batch = collate(random_rollouts(seed=3), pad_id=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy_loss(policy, batch)
    return adapters, sum(saved.values())


def test_lora_adapter_dtype_model_keeps_less_for_the_backward(tiny_model_dir):
    """float32 adapters (PEFT's default) cast each adapted layer's input to float32 and keep it
    for the backward; 'model' keeps the adapters, and so those inputs, in the model's dtype."""
    fp32_dtypes, fp32_bytes = _lora_saved_bytes(tiny_model_dir, "float32")
    model_dtypes, model_bytes = _lora_saved_bytes(tiny_model_dir, "model")
    assert fp32_dtypes == {torch.float32} and model_dtypes == {torch.bfloat16}
    print(f"saved for backward: float32 adapters {fp32_bytes} B, model-dtype {model_bytes} B")
    assert model_bytes < 0.9 * fp32_bytes, (model_bytes, fp32_bytes)


def test_flops_per_token_by_hand():
    class C:  # hidden 8, 2 layers, 2 heads of 4, 1 kv head, MLP 16, vocab 10
        hidden_size, num_hidden_layers, num_attention_heads = 8, 2, 2
        num_key_value_heads, head_dim, intermediate_size, vocab_size = 1, 4, 16, 10

    # per layer: q,o 8*8*2 = 128, k,v 8*4*2 = 64, MLP 3*8*16 = 384 -> 576; x2 layers = 1152;
    # + LM head 80 = 1232 weights -> 2464 forward FLOPs; attention 4*2*2*4*(6/2) = 192;
    # training = 3 * (2464 + 192) = 7968
    assert train_flops_per_token(C, seq_len=6) == 7968


def test_prompt_truncation_keeps_the_end_and_flags_it(tiny_model_dir):
    from transformers import AutoTokenizer

    from learner.step.rollouts import truncate_prompts

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, overlong = truncate_prompts(["abcdefghij", "xy"], tok, 4, {})
    assert overlong == [True, False]
    assert tok.decode(ids[0]) == "ghij" and tok.decode(ids[1]) == "xy"


def test_build_models_leaves_the_policy_in_train_mode(tiny_model_dir):
    # from_pretrained returns eval mode, where HF's checkpointed layers never recompute
    cfg = load_config(None, ['data.path="x.jsonl"', 'rewards=[{name="length"}]'])
    policy, _ = build_models(cfg, str(tiny_model_dir))
    assert cfg.model.gradient_checkpointing
    assert all(m.training for m in policy.modules())
    assert policy.model.is_gradient_checkpointing


@pytest.fixture
def compile_without_codegen(monkeypatch):
    """``Module.compile`` with the ``aot_eager`` backend: dynamo captures each layer's graph and
    AOTAutograd builds its backward, as with the default inductor backend, through the
    checkpointing and offloading hooks, but no kernels are generated. What the learner does is
    all there (which layers, compiled in place, names kept, the hooks); inductor's C++ build of
    the kernels alone took minutes on two CPU cores. Inductor runs for real on the GPU: the
    compiled rows of ``bench/bench_memory_options.py`` (docs/benchmarks.md, section 6)."""
    plain = torch.nn.Module.compile

    def compile(self, *args, **kwargs):
        kwargs.setdefault("backend", "aot_eager")
        return plain(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile)


@pytest.mark.slow
@pytest.mark.usefixtures("compile_without_codegen")
def test_compiled_layers_give_the_same_loss_and_gradients(tiny_model_dir):
    """``model.compile``: every decoder layer of the policy and of the KL reference compiled in
    place, under gradient checkpointing and activation offloading, on two batches of different
    lengths (one dynamic-shape graph): the eager path's loss, gradients and reference log-probs."""
    over = ['data.path="x.jsonl"', 'rewards=[{name="length"}]', "grpo.beta=0.1"]
    eager, eager_ref = build_models(load_config(None, over), str(tiny_model_dir))
    comp, comp_ref = build_models(
        load_config(None, [*over, "model.compile=true"]), str(tiny_model_dir)
    )
    assert comp_ref is not None and eager_ref is not None
    layers = comp.model.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert all(layer._compiled_call_impl is not None for layer in comp_ref.model.model.layers)
    assert eager.model.model.layers[0]._compiled_call_impl is None
    assert comp.state_dict().keys() == eager.state_dict().keys()  # syncs, checkpoints: same names

    offload = ActivationOffload(min_bytes=0)

    def offloaded(policy, batch):
        with offload():
            return policy_loss(policy, batch)

    for seed in (3, 4):
        batch = collate(random_rollouts(seed=seed), pad_id=0)
        want = _grads(eager, partial(policy_loss, eager, batch))
        _assert_same(want, _grads(comp, partial(policy_loss, comp, batch)))
        _assert_same(want, _grads(comp, partial(offloaded, comp, batch)))
        with torch.no_grad():
            torch.testing.assert_close(
                policy_forward(comp_ref, batch)[0],
                policy_forward(eager_ref, batch)[0],
                atol=1e-5,
                rtol=1e-5,
            )


@pytest.mark.slow
@pytest.mark.usefixtures("compile_without_codegen")
def test_compiled_layers_under_lora_give_the_same_gradients(tiny_model_dir):
    """``model.compile`` with PEFT LoRA: the base model's decoder layers are found through PEFT,
    only the adapters train, and the reference (adapters disabled) matches eager too."""
    over = ['data.path="x.jsonl"', 'rewards=[{name="length"}]', "model.lora.r=4", "grpo.beta=0.1"]
    torch.manual_seed(0)
    eager, _ = build_models(load_config(None, over), str(tiny_model_dir))
    comp, _ = build_models(load_config(None, [*over, "model.compile=true"]), str(tiny_model_dir))
    comp.load_state_dict(eager.state_dict())  # the same adapter initialisation
    assert sum(m._compiled_call_impl is not None for m in comp.modules()) == len(
        comp.model.get_base_model().model.layers
    )
    batch = collate(random_rollouts(seed=5), pad_id=0)
    _assert_same(
        _grads(eager, partial(policy_loss, eager, batch)),
        _grads(comp, partial(policy_loss, comp, batch)),
    )
    with torch.no_grad():
        torch.testing.assert_close(
            policy_forward(comp, batch, reference=True)[0],
            policy_forward(eager, batch, reference=True)[0],
            atol=1e-5,
            rtol=1e-5,
        )


def test_compile_is_refused_under_zero3_only(tiny_model_dir):
    from types import SimpleNamespace

    from learner.model.layout import plan_layout

    cfg = load_config(
        None,
        ['data.path="x.jsonl"', 'rewards=[{name="length"}]', "model.compile=true",
         "deepspeed.zero_stage=launch"],
    )  # fmt: skip

    def launch(stage: int) -> SimpleNamespace:  # what plan_layout reads of an accelerator
        ds = SimpleNamespace(zero_stage=stage, offload_optimizer_device="none",
                             offload_param_device="none", deepspeed_config={})  # fmt: skip
        return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=ds), num_processes=1,
                               device=torch.device("cpu"), is_main_process=True)  # fmt: skip

    assert plan_layout(launch(2), cfg, str(tiny_model_dir)).zero_stage == 2
    with pytest.raises(ValueError, match=r"model\.compile = false"):
        plan_layout(launch(3), cfg, str(tiny_model_dir))
