"""The `accelerate launch` prefix of the multi-process CPU tests: N gloo processes on this machine,
on a free port (not torchrun's default 29500, which another job may hold)."""

from __future__ import annotations

import sys


def cpu_launch(num_processes: int) -> list[str]:
    """``python -m accelerate.commands.launch ...``: append the script (or ``-m module``) and
    its arguments."""
    from grpo_common.net import free_port

    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu",  # accelerate's torchrun launcher; on a CPU-only machine it uses gloo
        "--num_processes", str(num_processes), "--num_machines", "1",
        "--main_process_port", str(free_port()),
        "--mixed_precision", "no", "--dynamo_backend", "no",
    ]  # fmt: skip
