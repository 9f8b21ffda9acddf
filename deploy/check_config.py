"""Check a learner launch command's config before any GPU work: exit 0 when it loads, 2 with the
learner's one-line message when it does not.

Container restart policies cannot tell a config error from a crash, and ``accelerate launch``
turns the learner's exit 2 into its own exit 1, so the learner's exit code alone cannot stop a
pointless restart. Run as a one-shot step before the learner (a compose service the learner
depends on, a Kubernetes init container, the SLURM script's first step), it stops the launch
at once on a bad setting while crashes of the real run are still restarted.

    python deploy/check_config.py accelerate launch [ACCELERATE ARGS] -m learner --config X ...
    python deploy/check_config.py python -m learner --config X ...

The arguments are the learner's launch command, unchanged: the same list the learner runs.
"""

from __future__ import annotations

import sys


def learner_args(argv: list[str]) -> list[str]:
    """The arguments ``python -m learner`` receives from a launch command."""
    if argv[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command_parser

        args = launch_command_parser().parse_args(argv[2:])
        if not (args.module and args.training_script == "learner"):
            raise SystemExit(f"not a learner launch: {' '.join(argv)}")
        return list(args.training_script_args)
    for prefix in (["python", "-m", "learner"], ["python3", "-m", "learner"], ["grpo-learner"]):
        if argv[: len(prefix)] == prefix:
            return argv[len(prefix) :]
    raise SystemExit(f"not a learner launch: {' '.join(argv)}")


def main(argv: list[str]) -> int:
    from learner.cli import args_config, train_parser
    from learner.config import ConfigError

    rest = learner_args(argv)
    sft = bool(rest) and rest[0] == "sft"
    args = train_parser(sft).parse_args(rest[1:] if sft else rest)
    try:
        cfg = args_config(args)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"config ok: {args.config} (run dir {cfg.run.run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
