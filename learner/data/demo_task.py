"""The synthetic demo task: a tiny random model learns it in minutes on two CPU cores.

Each prompt asks for a "song" made only of the letters in its ``allowed`` column (the vowels).
The reward is the fraction of the completion's characters that are allowed, so it lies in
[0, 1], starts near ``len(allowed) / vocab`` (about 0.02 for a random byte-level model) and
rises as the policy moves probability onto those tokens: enough signal for GRPO to show
learning within a few dozen steps, with no download and no pretrained weights.

Regenerate the shipped data with ``python -m learner.data.demo_task learner/data/demo.jsonl`` (it
writes ``demo_eval.jsonl`` beside it: held-out subjects, for the ``[eval]`` section).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SUBJECTS = ["the sea", "a cat", "the moon", "rain", "a bird", "the wind", "bread", "snow"]
HELD_OUT = ["the sun", "a fish", "the stars", "a tree"]  # in the eval prompts only
STYLES = ["Sing", "Hum", "Chant", "Whisper"]


def charset_reward(
    prompts: list[object], completions: list[str], allowed: list[str | None], **_: object
) -> list[float | None]:
    """Fraction of each completion's characters that belong to its row's ``allowed`` set.

    ``None`` (abstain) for rows without an ``allowed`` column; 0.0 for an empty completion."""
    out: list[float | None] = []
    for text, chars in zip(completions, allowed, strict=True):
        if chars is None:
            out.append(None)
        elif not text:
            out.append(0.0)
        else:
            out.append(sum(c in chars for c in text) / len(text))
    return out


def demo_rows(n: int = 64, seed: int = 0) -> list[dict[str, object]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = f"{rng.choice(STYLES)} a song about {rng.choice(SUBJECTS)} using only vowels."
        rows.append({"prompt": [{"role": "user", "content": text}], "allowed": "aeiou"})
    return rows


def demo_eval_rows() -> list[dict[str, object]]:
    """Every style with every held-out subject: prompts the training data never shows."""
    return [
        {
            "prompt": [
                {"role": "user", "content": f"{style} a song about {subject} using only vowels."}
            ],
            "allowed": "aeiou",
        }
        for style in STYLES
        for subject in HELD_OUT
    ]


def main(argv: list[str]) -> None:
    """Write the training rows to the path given, and the eval rows beside it (``*_eval``)."""
    path = Path(argv[0] if argv else "learner/data/demo.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in demo_rows()))
    held_out = path.with_name(f"{path.stem}_eval{path.suffix}")
    held_out.write_text("".join(json.dumps(r) + "\n" for r in demo_eval_rows()))
    print(path, held_out)


if __name__ == "__main__":
    main(sys.argv[1:])
