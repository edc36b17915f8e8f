"""Failure traces at a published large-cluster failure rate, for experiments at today's scale.

Meta's Llama 3 report ("The Llama 3 Herd of Models", 2024, section 3.3.4, Table 5) counts 419
unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs (466 in all, 47
of them planned). ``LLAMA3_PER_GPU_HOUR`` is that rate per GPU-hour; a cluster of ``nodes`` x
``gpus_per_node`` GPUs sees interruptions at ``nodes * gpus_per_node`` times it (1,024 nodes of
8: one every 6.2 hours).

``poisson_trace_text`` writes a trace (``oobleck.faults.trace`` format) of such a cluster: every
node up at time 0, interruptions as a seeded Poisson process, each taking one node chosen
uniformly among those up, the node coming back ``repair_h`` later (the report gives no repair
time: an assumption, stated where a trace is shipped). The first lines are comments recording
the parameters, so a shipped trace can be checked against its regeneration.

CLI: ``python -m oobleck.sim.failure_model --nodes 1024 --gpus-per-node 8 --duration-h 48
--repair-h 2 --seed 0 --out FILE``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

LLAMA3_INTERRUPTIONS = 419  # unexpected interruptions (Llama 3 report, Table 5)
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)


def poisson_trace_text(
    nodes: int,
    gpus_per_node: int,
    duration_h: float,
    repair_h: float,
    seed: int,
    per_gpu_hour: float = LLAMA3_PER_GPU_HOUR,
) -> str:
    """The trace text (module docstring); deterministic for the same arguments."""
    if nodes < 2 or gpus_per_node < 1 or duration_h <= 0 or repair_h < 0 or per_gpu_hour <= 0:
        raise ValueError(
            f"nodes={nodes} (>= 2), gpus_per_node={gpus_per_node} (>= 1), duration_h={duration_h} (> 0), "
            f"repair_h={repair_h} (>= 0), per_gpu_hour={per_gpu_hour} (> 0)"
        )
    rng = random.Random(seed)
    rate_per_s = per_gpu_hour * nodes * gpus_per_node / 3600.0
    end_ms = round(duration_h * 3600_000)
    up = [f"node{i}" for i in range(nodes)]
    returns: list[tuple[int, str]] = []  # (time_ms, node) of repaired nodes coming back
    events: list[tuple[int, str, str]] = [(0, "add", name) for name in up]
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        now = round(t * 1000)
        if now >= end_ms:
            break
        for back in sorted(r for r in returns if r[0] <= now):
            returns.remove(back)
            up.append(back[1])
            events.append((back[0], "add", back[1]))
        victim = up.pop(rng.randrange(len(up)))
        events.append((now, "remove", victim))
        returns.append((now + round(repair_h * 3600_000), victim))
    events += [(time, "add", name) for time, name in sorted(returns) if time < end_ms]
    events.sort(key=lambda e: (e[0], e[1] != "remove"))
    header = [
        "# Interruptions at the Llama 3 report's rate (oobleck/sim/failure_model.py): "
        f"{per_gpu_hour:.6g} per GPU-hour, nodes={nodes}, gpus_per_node={gpus_per_node},",
        f"# duration_h={duration_h:g}, repair_h={repair_h:g} (an assumption), seed={seed}",
    ]
    return "\n".join(header + [f"{time},{kind},{name}" for time, kind, name in events]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck.sim.failure_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--duration-h", type=float, required=True)
    parser.add_argument("--repair-h", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        text = poisson_trace_text(args.nodes, args.gpus_per_node, args.duration_h, args.repair_h, args.seed)
    except ValueError as error:
        parser.error(str(error))
    Path(args.out).write_text(text)
    removals = text.count(",remove,")
    print(f"written {args.out}: {removals} interruptions in {args.duration_h:g} h on {args.nodes} nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
