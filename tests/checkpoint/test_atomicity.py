"""A writer SIGKILLed mid-checkpoint leaves the previous checkpoint valid and the new one invisible.

The child process writes step 4 with the real functions and is killed at a chosen point: inside a
shard's write (its bytes come from a generator that stops halfway and waits to be killed), after
every shard but before the manifest, or inside the manifest's own write.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from ckpthelpers import WAIT_S, save

from oobleck.checkpoint import latest_valid, list_checkpoints, prepare_step_dir, prune, verify
from oobleck.checkpoint.durable import durable_write, is_temporary

pytestmark = pytest.mark.slow  # starts processes

CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {helpers!r})
    from ckpthelpers import trained_layers
    from oobleck.checkpoint import AsyncCheckpointWriter, Manifest, fingerprint, prepare_step_dir, snapshot
    from oobleck.checkpoint.durable import durable_write
    from oobleck.checkpoint.shard import _header
    from testing import tiny_config

    root, phase, marker = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])

    def stalled(first):
        yield first
        marker.write_text("stalled")  # the parent kills us now
        time.sleep({wait})
        raise SystemExit("not killed")

    cfg = tiny_config()
    layers = trained_layers(cfg, seed=1)  # a different state than the parent's step 2
    path = prepare_step_dir(root, 4)
    snap = snapshot(layers)
    with AsyncCheckpointWriter(threads=2, timeout_s={wait}) as writer:
        records = writer.submit(path, snap if phase != "mid-shard" else snapshot(layers[:-1])).result({wait})
    if phase == "mid-shard":
        last = snap.shards[len(layers) - 1]
        durable_write(path / "layer-0005.shard", stalled(_header(last.meta)))
    manifest = Manifest.build(4, fingerprint(cfg), records.values(), len(layers))
    if phase == "before-manifest":
        marker.write_text("stalled")
        time.sleep({wait})
    if phase == "mid-manifest":
        import json
        payload = json.dumps(manifest.to_dict()).encode()
        durable_write(path / "manifest.json", stalled(payload[: len(payload) // 2]))
    raise SystemExit("phase " + phase + " did not stall")
    """
)


def run_child_until_stalled(root: Path, phase: str) -> None:
    marker = root.parent / f"marker-{phase}"
    code = CHILD.format(helpers=str(Path(__file__).parent), wait=WAIT_S)
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(root), phase, str(marker)], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while not marker.exists():
            if child.poll() is not None:
                pytest.fail(f"child exited {child.returncode} before stalling: {child.stderr.read()}")
            if time.monotonic() > deadline:
                pytest.fail(f"child did not reach phase {phase} within {WAIT_S} s")
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=WAIT_S) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=WAIT_S)


@pytest.mark.parametrize("phase", ["mid-shard", "before-manifest", "mid-manifest"])
def test_sigkill_mid_checkpoint_keeps_the_previous_one(tmp_path, cfg, layers, phase):
    root = tmp_path / "checkpoints"
    older = save(root, 2, layers, cfg)
    before = {p.name: p.read_bytes() for p in older.iterdir()}
    run_child_until_stalled(root, phase)

    newer = root / "step-00000004"
    leftovers = [p.name for p in newer.iterdir() if is_temporary(p.name)]
    interrupted = {"mid-shard": ["layer-0005.shard"], "before-manifest": [], "mid-manifest": ["manifest.json"]}[phase]
    assert [name.split(".tmp-")[1].rsplit(".", 2)[0] for name in leftovers] == interrupted
    assert not (newer / "manifest.json").exists()
    if phase == "mid-shard":
        assert not (newer / "layer-0005.shard").exists()  # only its temporary name was ever written
    found = latest_valid(root)
    assert found.step_dir == older and verify(older) == []
    assert {p.name: p.read_bytes() for p in older.iterdir()} == before
    assert "manifest.json is missing" in found.skipped[0].problems[0]
    # retention never drops a newer, incomplete checkpoint (its write may still be going on) ...
    assert prune(root, keep=1) == [] and [e.step for e in list_checkpoints(root)] == [2, 4]
    # ... and the step can be written again from scratch, leftovers cleared
    assert prepare_step_dir(root, 4) == newer and not any(is_temporary(p.name) for p in newer.iterdir())
    save(root, 4, layers, cfg)
    assert latest_valid(root).step == 4 and prune(root, keep=1) == [older]


def test_an_exception_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "manifest.json"
    durable_write(target, [b"old"])

    def failing():
        yield b"new bytes, half of them"
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        durable_write(target, failing())
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
