"""``python -m rewards list``: every registered reward function and environment, with the
distribution that provides it. Exits with status 1 if a name is registered twice, or if a
distribution registers entry points under a group that looks like ours but is not read (a typo
such as ``grpo_service.reward``)."""

from __future__ import annotations

import argparse
import sys

from rewards.registry import find_duplicates, list_registered, misplaced_groups, misplaced_hint


def _list(kind: str | None) -> int:
    regs = list_registered(kind)  # type: ignore[arg-type]
    duplicates = find_duplicates(kind)  # type: ignore[arg-type]
    rows = [("KIND", "NAME", "DISTRIBUTION", "TARGET")]
    rows += [(r.kind, r.name, r.dist, r.target) for r in regs]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        flag = "  DUPLICATE" if (row[0], row[1]) in duplicates else ""
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)] + [row[3]]
        print("  ".join(cells) + flag)
    if not regs:
        print("(nothing registered)")
    for (k, name), dup in duplicates.items():
        dists = ", ".join(r.dist for r in dup)
        print(
            f"error: {k} {name!r} is registered by several distributions: {dists}", file=sys.stderr
        )
    misplaced = misplaced_groups()
    for group, wrong in misplaced.items():
        print(f"error: {misplaced_hint(group, wrong)}", file=sys.stderr)
    return 1 if duplicates or misplaced else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rewards", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="show registered reward functions and environments")
    ls.add_argument("--kind", choices=["reward", "environment"], default=None)
    args = parser.parse_args(argv)
    return _list(args.kind)


if __name__ == "__main__":
    sys.exit(main())
