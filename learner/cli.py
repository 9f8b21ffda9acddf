"""``python -m learner`` / ``accelerate launch -m learner``: train, evaluate, or plot a run.

    python -m learner --config learner/configs/demo.toml [--run-dir DIR] [--resume] [--set k=v ...]
    python -m learner sft --config learner/configs/sft_demo.toml [--run-dir DIR] [--resume] ...
    python -m learner plot RUN_DIR [--out FILE]
    python -m learner eval --config X [--model DIR] [--out DIR] [--set k=v ...]

One argparse parser: the subcommands are its subparsers (``python -m learner --help`` lists
them, each with its own ``--help``); without one it trains.

A GRPO config with an [sft] section runs the SFT first (into RUN_DIR/sft) and starts GRPO from it.

torch and transformers are imported only after the arguments parse, so ``--help`` is instant and
a bad config fails before any model loads.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from learner.config import LearnerConfig


SET_HELP = (
    "override one field, e.g. --set optim.lr=1e-5 (TOML value syntax: a list as "
    '--set \'sampling.stop=["a", "b"]\'); repeatable. The fields: docs/configuration.md'
)

COMMANDS = {
    "sft": "supervised fine-tuning alone, on the config's [sft] data",
    "eval": "evaluate a saved model on the config's [eval] section, once, without training",
    "plot": "draw a run's curves from its metrics.jsonl (RUN_DIR/curves.png)",
}


def _train_arguments(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument(
        "--config", required=required, help="TOML config (required; see learner/configs/)"
    )
    p.add_argument("--run-dir", help="overrides run.run_dir")
    p.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help=SET_HELP,
    )  # fmt: skip


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="TOML config with an [eval] section")
    p.add_argument(
        "--model",
        help="a saved model or checkpoint dir (e.g. RUN_DIR/final) or hub id, served by an "
        "embedded rollout server (default: model.name_or_path; not with rollout.servers)",
    )
    p.add_argument(
        "--out",
        help="where metrics.json and step_0.jsonl go (default: beside a --model directory, "
        "PARENT/eval/NAME: RUN_DIR/eval/final for RUN_DIR/final, RUN_DIR/eval/step_N for a "
        "checkpoint; else RUN_DIR/eval/standalone)",
    )
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help=SET_HELP,
    )  # fmt: skip


def _plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    p.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")


def train_parser(sft: bool = False) -> argparse.ArgumentParser:
    """The command line of ``python -m learner`` (GRPO; its subcommands listed in ``--help``
    and parsed by it), or with ``sft`` of ``python -m learner sft``."""
    if sft:
        p = argparse.ArgumentParser(
            prog="python -m learner sft",
            description="Supervised fine-tuning on the config's [sft] data (chunked NLL).",
        )
        _train_arguments(p)
        return p
    p = argparse.ArgumentParser(
        prog="python -m learner",
        usage="%(prog)s [-h] --config CONFIG [--run-dir RUN_DIR] [--resume] [--set K=V ...]\n"
        "       %(prog)s COMMAND ... (sft, eval, plot: see below)",
        description="GRPO learner: trains on the config's [data] and [[rewards]] (or "
        "[environment]). Without rollout.servers in the config it starts its own rollout "
        "server; an [sft] section runs a supervised warm start first.",
        epilog="Each subcommand has its own --help: python -m learner eval --help",
    )
    _train_arguments(p, required=False)  # not before a subcommand: checked in main()
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="subcommands")
    for name, (add, one_line) in {
        "sft": (_train_arguments, COMMANDS["sft"]),
        "eval": (_eval_arguments, COMMANDS["eval"]),
        "plot": (_plot_arguments, COMMANDS["plot"]),
    }.items():
        description = one_line[0].upper() + one_line[1:] + "."
        add(sub.add_parser(name, prog=f"{p.prog} {name}", help=one_line, description=description))
    return p


def args_config(args: argparse.Namespace) -> LearnerConfig:
    """The config a parsed command line names: its file, the ``--set`` overrides and
    ``--run-dir``. Raises ``ConfigError`` (one message naming the setting)."""
    from learner.config import load_config

    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run.run_dir={args.run_dir!r}".replace("'", '"'))
    return load_config(args.config, overrides)


def setup_logging() -> None:
    """INFO to the console, without what would bury the learner's own progress lines: httpx's
    line per request (several to each server every step), accelerate's line per file of every
    checkpoint (the learner says itself where it resumed from), matplotlib's font cache note,
    and accelerate's warning that a tied output embedding was left out of a checkpoint."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in ("httpx", "httpcore", "accelerate.accelerator", "accelerate.checkpointing",
                 "matplotlib"):  # fmt: skip
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("accelerate.utils.other").addFilter(not_a_tied_embedding_notice)


_REMOVED_SHARED = re.compile(r"Removed shared tensor \{(.*?)\} while saving")


def not_a_tied_embedding_notice(record: logging.LogRecord) -> bool:
    """False for accelerate's "Removed shared tensor {'model.lm_head.weight'} while saving"
    warning, which every checkpoint of a model with tied embeddings (Qwen3 up to 4B) gives:
    the output embedding is the input embedding, and loading ties them again. A shared tensor
    under any other name still warns."""
    found = _REMOVED_SHARED.search(record.getMessage())
    if found is None:
        return True
    names = [n.strip().strip("'\"") for n in found.group(1).split(",")]
    return not all(n.endswith("lm_head.weight") for n in names)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    parser = train_parser()
    args = parser.parse_args(argv)
    if args.command == "plot":
        from learner.run.plot import plot_run

        try:
            print(plot_run(args.run_dir, args.out))
        except (FileNotFoundError, ValueError) as e:  # not a run dir, or nothing logged yet
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "eval":
        return _eval(args)
    if args.config is None:
        parser.error("the following arguments are required: --config")
    from learner.config import ConfigError

    try:
        cfg = args_config(args)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    return _guarded(lambda: _run(args, cfg, args.command == "sft"))


def _guarded(run: Callable[[], int]) -> int:
    """``run()``, with the errors that name a setting to change as one line (exit 2), rollout
    servers that stayed away as one line (exit ``SERVERS_LOST_EXIT``), a checkpoint or final
    model that could not be written as one line (exit ``CHECKPOINT_WRITE_EXIT``), and a user's
    reward or environment code that failed as its own frames (exit 1)."""
    from learner.run.runtime import StoppedBeforeTraining, TrainingStopped

    try:
        return run()
    except (TrainingStopped, StoppedBeforeTraining) as e:
        print(f"error: {e}", file=sys.stderr)
        return 143  # 128 + SIGTERM, as if it had ended the process: the run is not finished
    except Exception as e:
        from learner.data.prompts import DataError
        from learner.run.checkpoint import CHECKPOINT_WRITE_EXIT, CheckpointWriteError
        from learner.run.runtime import SetupError
        from learner.servers.pool import SERVERS_LOST_EXIT, ServersLostError
        from learner.step.rollouts import EpisodesFailedError
        from rewards.errors import PluginError
        from rewards.scoring import RewardFunctionError, RewardSpecError

        if isinstance(e, ServersLostError):  # says which server, the setting and to --resume
            print(f"error: {e}", file=sys.stderr)
            return SERVERS_LOST_EXIT
        if isinstance(e, CheckpointWriteError):  # a full disk: free space, then --resume
            print(f"error: {e}", file=sys.stderr)
            return CHECKPOINT_WRITE_EXIT
        if isinstance(e, (RewardFunctionError, EpisodesFailedError)):  # the user's code failed
            print(user_traceback(e.__cause__) + f"error: {e}", file=sys.stderr)
            return 1
        if not isinstance(e, (SetupError, DataError, PluginError, RewardSpecError)):
            raise
        print(f"error: {e}", file=sys.stderr)  # names the setting to change: no traceback
        return 2


def _eval(args: argparse.Namespace) -> int:
    from learner.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if cfg.eval is None:
        print(f"{args.config} has no [eval] section: add one (docs/training.md, Held-out "
              "evaluation)", file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.out) if args.out else eval_dir(args.model, Path(cfg.run.run_dir))

    def run() -> int:
        from learner.evaluate import evaluate_model

        metrics = evaluate_model(cfg, args.model, out)
        width = max(map(len, metrics))
        for k, v in metrics.items():
            print(f"{k:<{width}}  {v:.4g}")
        print(f"samples and metrics in {out}")
        return 0

    return _guarded(run)


def eval_dir(model: str | None, run_dir: Path) -> Path:
    """Where ``eval`` writes without ``--out``: beside a ``--model`` directory, in its parent's
    ``eval/NAME`` (``RUN_DIR/final`` → ``RUN_DIR/eval/final``; a checkpoint
    ``RUN_DIR/checkpoints/step_N`` → ``RUN_DIR/eval/step_N``), else (a hub id, the config's
    model) in the config's ``RUN_DIR/eval/standalone``."""
    if model is None or not Path(model).is_dir():
        return run_dir / "eval" / "standalone"
    path = Path(model).resolve()
    parent = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return parent / "eval" / path.name


def user_traceback(e: BaseException | None) -> str:
    """The traceback of what a reward function raised, from the function's own frame on (not
    the thread and runner frames that called it); empty if nothing raised."""
    import traceback

    import grpo_common.threads
    import rewards.scoring

    if e is None:
        return ""
    callers = {grpo_common.threads.__file__, rewards.scoring.__file__}
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in callers:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb or e.__traceback__))


def _run(args: argparse.Namespace, cfg: LearnerConfig, sft: bool) -> int:
    if sft:
        if cfg.sft is None:
            print(
                f"{args.config} has no [sft] section: add one (see learner/configs/)",
                file=sys.stderr,
            )
            return 2
        from learner.sft import train_sft

        last = train_sft(cfg, resume=args.resume)
        if last:
            print(f"done: SFT in {cfg.run.run_dir} (loss={last['loss']:.4g})")
        return 0
    if not cfg.has_grpo:
        print(
            f"{args.config} has only an [sft] section: run `python -m learner sft --config "
            f"{args.config}`, or add [data] and [[rewards]] (or [environment]) for GRPO after it",
            file=sys.stderr,
        )
        return 2
    from learner.trainer import train

    last = train(cfg, resume=args.resume)
    if last:
        summary = ", ".join(f"{k}={last[k]:.4g}" for k in ("reward/mean", "loss") if k in last)
        print(f"done: {cfg.run.steps} steps in {cfg.run.run_dir} ({summary})")
    return 0
