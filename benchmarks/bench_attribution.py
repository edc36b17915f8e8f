"""What sets each headline ratio: Oobleck over each baseline with each fairness switch on and off.

    python benchmarks/bench_attribution.py [--steps 24] [--nodes 4] [--repeats 3] [--failures 1]
                                           [--notice-s 3] [--out DIR] [--only VARIANT ...] [--all]

Every variant below runs under the protocol of ``benchmarks/protocol.py`` (interleaved repeats with
a rotated order, failure steps at seeded random offsets never on a checkpoint boundary, the same
draws and one heartbeat timeout for every variant, crash and hang in separate rows, each run's
host recorded), on gpt3_tiny and ``--nodes`` local nodes. A variant turns one switch away from a
system's faithful default (the first variant of each system):

- torchft: quorum asynchronous (torchft's default) / synchronous (the batch split over the quorum);
- Varuna: layout rule ``varuna`` (its own) / ``oobleck_templates``; no notice / a preemption notice
  of ``--notice-s`` seconds on every removal (long enough to write a checkpoint; crash rows only);
- Bamboo: redundancy ``lazy`` (its default) / ``eager`` (and with ``--all`` the harness's earlier
  ``inline``); rebalance off (faithful) / on;
- Oobleck: today's reconfiguration (``oobleck``, the reference of every ratio) / the paper's
  (``oobleck_sosp23``);
- crash (SIGKILL, seen at once) / hang (SIGSTOP, seen after the heartbeat timeout): the fault column.
  Hangs run the faithful default of each system (with ``--all`` every variant): a hang changes the
  detection, which no other switch touches.

Oobleck ignores notices (``oobleck/strategies/oobleck.py``), so a noticed variant is paired with
Oobleck's run without notice (whose kill comes ``--notice-s`` earlier, in an earlier step; with
``--all`` Oobleck also runs under the notice and the pairing uses that run).

Written to ``DIR``: protocol.json and the run dirs, ``attribution.csv`` (one row per fault type and
variant: medians with min-max over the repeats, the host's load) and ``attribution.md`` (the same as
a markdown table, with the command, the host and the warnings). Bounded time: (crash variants +
hang variants) x repeats runs, each a fresh cluster of ``--nodes`` processes plus a run of
``--steps`` steps: at the defaults (10 + 4) x 3 = 42 runs, 30-60 s each on a 2-core host shared
with other jobs (load 10-18): 25-40 minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from protocol import Variant, add_protocol_arguments, protocol_out, run_tiny_protocol  # noqa: E402

NOTICE = "notice"  # the switch whose variants run only the crash schedule (a hang gets no notice)
# Run by default under hangs too: each system's faithful default.
HANG_VARIANTS = ("oobleck", "torchft", "varuna", "bamboo")
# Run only with --all: a mode that is no real system's, and Oobleck under a notice it ignores.
EXTRA_VARIANTS = ("bamboo-inline", "oobleck+notice")


def variants(notice_s: float) -> list[Variant]:
    """The faithful default of each system first, then one variant per switch."""
    return [
        Variant("oobleck", "oobleck", switch="reference"),
        Variant("oobleck_sosp23", "oobleck_sosp23", switch="paper vs improved Oobleck"),
        Variant("oobleck+notice", "oobleck", switch=NOTICE, notice_s=notice_s),
        Variant("torchft", "torchft", switch="faithful (async quorum)"),
        Variant("torchft-sync", "torchft", (("strategy.async_quorum", False),), switch="quorum sync"),
        Variant("varuna", "varuna", switch="faithful (layout varuna, no notice)"),
        Variant(
            "varuna-templates",
            "varuna",
            (("strategy.layout_rule", "oobleck_templates"),),
            switch="layout oobleck_templates",
        ),
        Variant("varuna+notice", "varuna", switch=NOTICE, notice_s=notice_s),
        Variant("bamboo", "bamboo", switch="faithful (lazy, no rebalance)"),
        Variant("bamboo-eager", "bamboo", (("strategy.redundancy", "eager"),), switch="redundancy eager"),
        Variant("bamboo-inline", "bamboo", (("strategy.redundancy", "inline"),), switch="redundancy inline"),
        Variant("bamboo-rebalance", "bamboo", (("strategy.rebalance", True),), switch="rebalance on"),
        Variant("recycle", "recycle", switch="faithful (re-route through peers, no spares)"),
    ]


def markdown(summary, header: list[str], warnings: list[str]) -> str:
    columns = ["fault", "variant", "switch", "repeats", "goodput", "goodput_ratio", "recovery_s", "recovery_ratio"]
    columns += ["redone_steps", "load_1min"]
    lines = [*header, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in summary[columns].astype(str).to_dict(orient="records"):
        lines.append("| " + " | ".join(row[c] for c in columns) + " |")
    return "\n".join([*lines, "", *warnings]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_protocol_arguments(parser, steps=24, nodes=4, failures=1)
    parser.add_argument("--notice-s", type=float, default=3.0, help="the notice of the notice variants")
    parser.add_argument("--only", nargs="*", default=None, help="run only these variants (oobleck always)")
    parser.add_argument("--all", action="store_true", help="every variant, and every variant under hangs too")
    args = parser.parse_args()

    from analysis.comparison import host_warnings, protocol_summary, protocol_table

    chosen = [
        v
        for v in variants(args.notice_s)
        if (not args.only or v.name in {"oobleck", *args.only}) and (args.all or v.name not in EXTRA_VARIANTS)
    ]
    crash_only = {v.name for v in chosen if v.switch == NOTICE or not (args.all or v.name in HANG_VARIANTS)}
    out = protocol_out(args.out, "bench_attribution")
    start_load = os.getloadavg()
    started = time.time()
    print(f"load average {start_load} on {os.cpu_count()} cores; run dirs under {out}", flush=True)
    run_tiny_protocol(chosen, args, out, faults=("crash", "hang"), crash_only=crash_only)
    table = protocol_table(out)
    summary = protocol_summary(table)
    summary.to_csv(out / "attribution.csv", index=False)
    header = [
        f"`python benchmarks/bench_attribution.py{' --all' if args.all else ''} --steps {args.steps} --nodes {args.nodes} --repeats {args.repeats} "
        f"--failures {args.failures} --notice-s {args.notice_s:g} --seed {args.seed}`: gpt3_tiny, "
        f"heartbeat timeout {args.heartbeat_timeout_s:g} s, {len(table)} runs in {(time.time() - started) / 60:.0f} min; "
        f"host {os.cpu_count()} cores, load average {start_load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
        "Median [min-max] over the repeats; goodput_ratio = Oobleck's goodput / this variant's, recovery_ratio = "
        "this variant's median failure recovery / Oobleck's, both paired round by round ('*': measured with more "
        "training processes than cores).",
    ]
    (out / "attribution.md").write_text(markdown(summary, header, host_warnings(table)))
    print((out / "attribution.md").read_text())


if __name__ == "__main__":
    main()
