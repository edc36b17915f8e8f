"""One restarted worker's start, timed part by part (``gpu_check``'s restart unit runs it afresh).

    python benchmarks/gpu_check_units/restart_probe.py --spawned-at T --device cuda --plan PLAN.json --out OUT.json

Its first statement reads the clock, before any import, so ``process_start_s`` is the interpreter's
start from the parent's ``Popen`` (``--spawned-at``, the parent's ``time.time()``). Then, in the
order a worker restarted from a checkpoint pays them: importing torch, importing the harness's
worker (and the optimizer's first construction), the CUDA context, a one-rank process group's creation and first collective per backend,
building the model's layer shells with their AdamW state on the device, reading the checkpoint of
known size from local disk into them (the parent evicted it from the page cache), and the first
training step against the steady ones; also a fresh start's seeded initialisation and the
device-to-host copy rate a checkpoint snapshot runs at.
"""

import time

STARTED = time.time()  # the clock before anything else: the process's start

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spawned-at", type=float, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    plan = json.loads(args.plan.read_text())
    times: dict = {"process_start_s": STARTED - args.spawned_at}

    clock = time.perf_counter()
    import torch
    import torch.distributed as dist

    times["torch_import_s"] = time.perf_counter() - clock
    clock = time.perf_counter()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # gpu_check_units
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # testing (the checkout)
    import oobleck.runtime.worker  # noqa: F401  (what a worker imports before its first step)
    from gpu_check_units.common import MIB, SoloRun, local_store, tf32_off
    from oobleck.checkpoint.manifest import ShardRecord
    from oobleck.checkpoint.shard import restore_layer
    from oobleck.config import load_model_config
    from oobleck.models import model_spec
    from oobleck.runtime.backend import GlooBackend, NcclBackend
    from oobleck.runtime.state import layer_state
    from testing import tiny_config

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its one-time imports, as a worker pays them at start
    times["harness_import_s"] = time.perf_counter() - clock
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        clock = time.perf_counter()
        torch.cuda.init()
        torch.empty(1, device="cuda")
        sync()
        times["cuda_context_s"] = time.perf_counter() - clock
        tf32_off()

    times["group_init_s"] = {}
    with local_store() as store:
        loopback = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        backends = [("gloo", GlooBackend(loopback, device=args.device))] + (
            [("nccl", NcclBackend(device="cuda"))] if cuda else []
        )
        for name, backend in backends:
            clock = time.perf_counter()
            group = backend.new_group(dist.PrefixStore(f"probe-{name}", store), 0, 1, 60.0)
            tensor = torch.ones(1024, device=args.device)
            group.allreduce([tensor]).wait()  # NCCL makes its communicator at the first collective
            sync()
            times["group_init_s"][name] = time.perf_counter() - clock

    cfg = tiny_config()
    model = load_model_config(plan["model"], **plan["overrides"])
    spec = model_spec(model, 0)
    clock = time.perf_counter()
    layers = [layer_state(spec, cfg.job, i, args.device, initialise=False) for i in range(spec.num_layers)]
    sync()
    times["model_build_s"] = time.perf_counter() - clock
    clock = time.perf_counter()
    step_dir = Path(plan["step_dir"])
    for record, layer in zip(plan["records"], layers, strict=True):
        restore_layer(step_dir, ShardRecord(**record), layer, plan["step"])
    sync()
    times["checkpoint_read_s"] = time.perf_counter() - clock
    del layers
    clock = time.perf_counter()
    seeded = spec.build_layers(range(spec.num_layers), args.device)
    sync()
    times["model_init_s"] = time.perf_counter() - clock
    del seeded

    if cuda:
        source = torch.empty(plan["host_copy_mib"] * MIB // 4, device="cuda")
        target = torch.empty(source.shape, pin_memory=True)
        target.copy_(source)  # the first copy pays the pinned pages' mapping
        sync()
        clock = time.perf_counter()
        target.copy_(source)
        sync()
        times["host_copy_gbps"] = source.numel() * 4 / (time.perf_counter() - clock) / 1e9
        del source, target

    first = tiny_config(**{"job.steps": 4, "job.global_batch_size": 8, "job.microbatch_size": 2})
    first.model = load_model_config(plan["first_step_model"])
    with local_store() as store:
        run = SoloRun(first, args.device, store)
        try:
            durations = []
            for step in range(4):
                clock = time.perf_counter()
                run.step(step)
                sync()
                durations.append(time.perf_counter() - clock)
        finally:
            run.close()
    times["first_step"] = {"first_s": durations[0], "steady_s": sorted(durations[1:])[1], "steps_s": durations}
    args.out.write_text(json.dumps(times))


if __name__ == "__main__":
    main()
