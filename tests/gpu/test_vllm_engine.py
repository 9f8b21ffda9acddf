"""The vLLM engine through HTTP: a real ``rollout-server --engine vllm`` on GPU 0 serving a
random-weight Qwen3-0.6B-shaped model.

Covered: generation (ids/text/chat prompts, n, seeds, ignore_eos), log-probs under the sampling
distribution (checked against a transformers forward pass, and exactly 0 when top_k=1 leaves a
single candidate), weight loads over HTTP and from files reaching the model (a hand-computed
uniform distribution), sleep levels 1 and 2 freeing memory and waking up with the right weights.
"""

from __future__ import annotations

import math
import statistics

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(24)] for i in range(4)]  # byte tokens


@pytest.fixture(scope="module")
def server(qwen3_dir, log_dir):
    import torch
    from gpu_common import ServerProcess, free_gpu_bytes

    torch.cuda.init()
    baseline = free_gpu_bytes(0)  # before vLLM: what the server will hold is measured from here
    # No prefix caching: a cached prefix changes the arithmetic (and this random model's greedy
    # choices are near-ties), so comparisons between calls would be flaky.
    proc = ServerProcess(
        qwen3_dir,
        gpu="0",
        extra_args=["--no-enable-prefix-caching"],
        log_path=log_dir / "test_vllm_engine.server.log",
    )
    proc.start()
    proc.baseline_free = baseline
    proc.held = baseline - free_gpu_bytes(0)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(server):
    """Greedy continuations of PROMPTS with the served (file) weights."""
    from gpu_common import greedy

    return greedy(server, PROMPTS)


def test_info(server) -> None:
    info = server.info()
    assert info["engine"] == "vllm" and info["dtype"] == "bfloat16"
    assert info["vocab_size"] == 151936 and info["max_model_len"] == 2048
    assert "nccl" in info["weight_transports"] and info["weight_version"] == 0
    # vLLM's batch defaults (its offline LLM's), not the engine context's 128 / 2048
    assert info["max_num_seqs"] == 1024 and info["max_batch_tokens"] == 16384


def test_generate_text_chat_and_ids(server) -> None:
    request = dict(
        prompts=["The capital of France is", [{"role": "user", "content": "Hi!"}], PROMPTS[0]],
        n=4,
        max_tokens=16,
        temperature=1.0,
        seed=0,
    )
    out = server.generate(**request)
    assert out["weight_version"] == 0 and len(out["results"]) == 3
    # The tiny tokenizer: ids 0-255 are bytes, 257 = <|im_start|>, 258 = <|im_end|>.
    text_ids, chat_ids, ids = (r["prompt_token_ids"] for r in out["results"])
    assert text_ids == list(b"The capital of France is")
    assert chat_ids == [257, *b"user\nHi!", 258, 10, 257, *b"assistant\n"]
    assert ids == PROMPTS[0]
    for r in out["results"]:
        assert len(r["samples"]) == 4
        for s in r["samples"]:
            assert 1 <= len(s["token_ids"]) <= 16 and len(s["logprobs"]) == len(s["token_ids"])
            assert all(lp <= 1e-6 and math.isfinite(lp) for lp in s["logprobs"])
            assert s["finish_reason"] in ("stop", "length")
    again = server.generate(**request)
    assert [[s["token_ids"] for s in r["samples"]] for r in again["results"]] == [
        [s["token_ids"] for s in r["samples"]] for r in out["results"]
    ], "same seed, same weights, same request: same samples"
    samples = [s["token_ids"] for s in out["results"][2]["samples"]]
    assert len({tuple(s) for s in samples}) > 1, "the n samples of a seeded request must differ"


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of positions at which two calls' samples hold the same token. vLLM's
    numerics depend on the batch (not batch-invariant): two calls with the same seed can flip
    a near-tie (this random model's logits are nearly flat), one token, and the seeded noise
    keeps the rest. Different seeds agree on ~0 of the 151936-token vocabulary."""
    same = sum(p == q for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=False))
    return same / sum(max(len(x), len(y)) for x, y in zip(a, b, strict=True))


def _tokens(out: dict) -> list[list[int]]:
    return [s["token_ids"] for r in out["results"] for s in r["samples"]]


def test_logprobs_false_gives_the_same_samples_without_logprobs(server) -> None:
    request = dict(prompts=PROMPTS[:2], n=4, max_tokens=16, temperature=1.0, seed=1)
    full = server.generate(**request)
    bare = server.generate(**request, logprobs=False)
    assert _agreement(_tokens(full), _tokens(bare)) >= 0.95
    for a, b in zip(full["results"], bare["results"], strict=True):
        assert all(s["logprobs"] == [] for s in b["samples"])
        assert all(len(s["logprobs"]) == len(s["token_ids"]) for s in a["samples"])


def test_prompt_k_of_a_seeded_request_draws_from_seed_plus_k_times_n(server) -> None:
    """A prompt repeated in a seeded request gets new samples, and the second copy's are what
    a request of that prompt alone draws at seed + n (as on the transformers engine)."""
    ids = PROMPTS[0]
    both = server.generate(prompts=[ids, ids], n=3, max_tokens=24, temperature=1.0, seed=40)
    alone = server.generate(prompts=[ids], n=3, max_tokens=24, temperature=1.0, seed=43)
    first, second = ([s["token_ids"] for s in r["samples"]] for r in both["results"])
    assert _agreement(first, second) < 0.2
    assert _agreement(second, _tokens(alone)) >= 0.95


def test_ignore_eos_gives_exact_lengths(server) -> None:
    out = server.generate(prompts=PROMPTS, n=2, max_tokens=40, ignore_eos=True, temperature=1.0)
    for r in out["results"]:
        for s in r["samples"]:
            assert len(s["token_ids"]) == 40 and s["finish_reason"] == "length"


def test_logprobs_are_the_sampling_distribution(server, qwen3_dir) -> None:
    """At temperature 0.7 the reported log-prob of each sampled token equals
    log_softmax(logits / 0.7) from a transformers forward pass (bf16 both sides)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = server.generate(
        prompts=PROMPTS, n=2, max_tokens=32, ignore_eos=True, temperature=0.7, seed=1
    )
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.bfloat16).cuda().eval()
    diffs = []
    with torch.no_grad():
        for prompt, r in zip(PROMPTS, out["results"], strict=True):
            for s in r["samples"]:
                ids = torch.tensor([prompt + s["token_ids"]], device="cuda")  # [1, P+T]
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
                ref = torch.log_softmax(logits / 0.7, -1)
                got = ref.gather(1, torch.tensor(s["token_ids"], device="cuda")[:, None])[:, 0]
                diffs += (got.cpu() - torch.tensor(s["logprobs"])).abs().tolist()
    del model
    torch.cuda.empty_cache()
    assert statistics.median(diffs) < 0.05, statistics.median(diffs)
    assert max(diffs) < 0.5, max(diffs)


def test_processed_logprobs_after_top_k(server) -> None:
    """top_k=1 leaves one candidate: under the sampling distribution its log-prob is 0 (raw
    log-probs would be about -log(151936) = -11.9 for this near-uniform random model). It failed
    once on 2xH200 (the report was cut by the suite's time limit); ties are the likely cause."""
    out = server.generate(
        prompts=PROMPTS, n=2, max_tokens=12, ignore_eos=True, temperature=1.0, top_k=1
    )
    lps = [lp for r in out["results"] for s in r["samples"] for lp in s["logprobs"]]
    # bf16 logits of a near-uniform model can tie at the top: top_k keeps every tied token, so a
    # step may carry log(1/2); raw log-probs would be near -11.9 at every step.
    assert all(lp > -math.log(3) for lp in lps), lps
    assert sum(abs(lp) < 1e-4 for lp in lps) >= 0.9 * len(lps), lps


def test_http_weight_update_reaches_the_model(server, qwen3_dir, reference) -> None:
    """A zero final norm makes every logit 0: greedy picks token 0 and every log-prob is exactly
    -log(vocab). Reloading the files restores the original greedy outputs."""
    import safetensors.torch
    import torch
    from gpu_common import greedy

    blob = safetensors.torch.save({"model.norm.weight": torch.zeros(1024, dtype=torch.bfloat16)})
    r = server.http.post(
        "/weights/update", content=blob, headers={"Content-Type": "application/octet-stream"}
    )
    assert r.status_code == 200, r.text
    version = r.json()["weight_version"]
    out = server.generate(
        prompts=PROMPTS[:2], n=1, max_tokens=8, temperature=1.0, ignore_eos=True, seed=0
    )
    uniform = -math.log(151936)
    for res in out["results"]:
        s = res["samples"][0]
        assert res["samples"][0]["weight_version"] == version
        assert all(abs(lp - uniform) < 1e-3 for lp in s["logprobs"]), s["logprobs"]
    assert greedy(server, PROMPTS[:2], max_tokens=8).tokens == [[0] * 8, [0] * 8]
    r = server.post("/weights/load_file", {"path": str(qwen3_dir)})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == version + 1
    after = greedy(server, PROMPTS)
    assert after.matches(reference), after.mismatch(reference)


def test_bad_update_is_refused_and_changes_nothing(server, reference) -> None:
    import safetensors.torch
    import torch
    from gpu_common import greedy

    before = server.info()["weight_version"]
    blob = safetensors.torch.save({"model.norm.weight": torch.zeros(1024)})  # float32: refused
    r = server.http.post(
        "/weights/update", content=blob, headers={"Content-Type": "application/octet-stream"}
    )
    assert r.status_code == 400 and "dtype float32" in r.text
    assert server.info()["weight_version"] == before
    after = greedy(server, PROMPTS)
    assert after.matches(reference), after.mismatch(reference)


def _sleep(server, level: int) -> int:
    from gpu_common import free_gpu_bytes

    before = free_gpu_bytes(0)
    r = server.post("/sleep", {"level": level})
    assert r.status_code == 200 and r.json() == {"is_sleeping": True, "level": level}
    return free_gpu_bytes(0) - before


def test_sleep_level_1_frees_memory_and_wakes_with_the_same_weights(server, reference) -> None:
    from gpu_common import greedy

    freed = _sleep(server, 1)
    assert freed >= 0.8 * server.held, (freed, server.held)
    r = server.post("/generate", {"prompts": PROMPTS, "max_tokens": 4})
    assert r.status_code == 503 and "asleep" in r.text
    assert server.post("/wake_up", {}).status_code == 200
    after = greedy(server, PROMPTS)
    assert after.matches(reference), after.mismatch(reference)


def test_sleep_level_2_needs_weights_before_generating(server, qwen3_dir, reference) -> None:
    from gpu_common import greedy

    freed = _sleep(server, 2)
    assert freed >= 0.8 * server.held, (freed, server.held)
    assert server.post("/wake_up", {"tags": ["weights"]}).status_code == 200
    r = server.post("/generate", {"prompts": PROMPTS, "max_tokens": 4})
    assert r.status_code == 503
    r = server.post("/weights/load_file", {"path": str(qwen3_dir)})
    assert r.status_code == 200, r.text
    r = server.post("/generate", {"prompts": PROMPTS, "max_tokens": 4})
    assert r.status_code == 503 and "asleep" in r.text  # the KV cache is still asleep
    assert server.post("/wake_up", {"tags": ["kv_cache"]}).status_code == 200
    after = greedy(server, PROMPTS)
    assert after.matches(reference), after.mismatch(reference)
