"""What a ZeRO-3 model's ``save_pretrained`` writes, against ``learner.model.export.save_model``.

Run on a GPU under ``accelerate launch --config_file deploy/accelerate/zero3.yaml
--num_processes 1 bench/probe_zero3_save.py OUT_DIR``: builds the demo's tiny Qwen3, prepares it
with DeepSpeed ZeRO-3, saves it both ways and prints one JSON line per way: how many tensors
came out empty or at a shape other than the model's. (``save_pretrained`` on the unwrapped
module writes what this rank holds: under ZeRO-3 an empty shard of each tensor.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner.model.export import save_model
from learner.model.policy import PolicyLogprobs
from learner.run.runtime import make_accelerator
from rollout_server.tiny import save_tiny_model


def _report(way: str, base: dict[str, torch.Tensor], path: Path) -> dict[str, object]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        got.update(load_file(str(f)))
    wrong = [k for k, t in base.items() if k not in got or got[k].shape != t.shape]
    return {
        "way": way,
        "tensors": len(base),
        "wrong_shape_or_missing": len(wrong),
        "example": {k: list(got[k].shape) for k in wrong[:2] if k in got},
    }


def main(out: str) -> None:
    acc = make_accelerator()
    root = Path(out)
    model_dir = save_tiny_model(root / "model")
    base = load_file(str(model_dir / "model.safetensors"))
    policy = PolicyLogprobs(AutoModelForCausalLM.from_pretrained(model_dir))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy, opt = acc.prepare(policy, opt)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if acc.is_main_process:  # the plain way: save_pretrained on the unwrapped module
        acc.unwrap_model(policy).model.save_pretrained(root / "old", safe_serialization=True)
    save_model(acc, policy, tokenizer, root / "new")
    if acc.is_main_process:
        for way in ("old", "new"):
            print(json.dumps(_report(way, base, root / way)), flush=True)
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
