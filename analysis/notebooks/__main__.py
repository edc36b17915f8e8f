"""``python -m analysis.notebooks list|run NAME [-p key=value ...] [--out FILE.ipynb]``."""

from __future__ import annotations

import argparse
import sys

from analysis.notebooks import execute, names, parse_value
from oobleck.errors import ConfigError, report_errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m analysis.notebooks", description="Run the analysis notebooks headless."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the notebooks")
    run = sub.add_parser("run", help="execute a notebook with parameters")
    run.add_argument("name")
    run.add_argument(
        "-p",
        "--parameter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter (Python literal, else text); repeatable",
    )
    run.add_argument("--out", default=None, help="write the executed notebook here (default: NAME.ipynb)")
    run.add_argument("--cwd", default=".", help="working directory of the kernel (relative paths resolve here)")
    run.add_argument("--timeout-s", type=float, default=600.0, help="per-cell time limit")
    args = parser.parse_args(argv)
    with report_errors("analysis.notebooks"):
        if args.command == "list":
            print("\n".join(names()))
            return 0
        parameters = {}
        for item in args.parameter:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"-p {item!r}: write it as KEY=VALUE, e.g. -p bin_s=600")
            parameters[key.strip()] = parse_value(value)
        out = args.out or f"{args.name}.ipynb"
        execute(args.name, parameters, out=out, cwd=args.cwd, timeout_s=args.timeout_s)
        print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
