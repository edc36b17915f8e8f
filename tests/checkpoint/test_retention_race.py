"""The retention race of a restart (issue 28, item 9), forced: a checkpoint a decision refers to is
never pruned.

What happened under load: a Bamboo run restarted from checkpoint 56 after a failure; the
controller had just read the commits of the steps in flight (``StepLedger.take_in_flight``), two
of them with a checkpoint after them (boundaries 64 and 72), queued for the checkpoint
coordinator. The rollback to 56 did not drop those queued boundaries, so on the next loop they
were taken up, the old generation's writers (which had written those shards before they were
stopped) had reported every record, both checkpoints completed, and retention (``keep=2``)
removed 56, which the restart's workers were still to load ("manifest.json is missing").

Here the same interleaving runs on the controller's real parts: the ledger and the checkpoint
coordinator on a real store in the run's key space, real shards and manifests on disk. Two
things stop it, each checked alone: the rollback drops the checkpoints of the steps it rolls back,
and the coordinator never prunes a checkpoint pinned by a decision (the restart pins the one it
loads until its workers hold the state).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from ckpthelpers import WAIT_S, save

from oobleck.checkpoint import AsyncCheckpointWriter, list_checkpoints, read_manifest, step_dir
from oobleck.elastic.checkpoints import CheckpointCoordinator
from oobleck.elastic.ledger import StepLedger
from oobleck.runtime import keys
from oobleck.runtime.checkpointing import restore_layers
from oobleck.runtime.sealed_store import SealedStore
from oobleck.runtime.state import new_layer_state
from oobleck.strategy import Layout
from testing import hand_plan, template

ROLLBACK = 56
ZOMBIES = (64, 72)  # checkpoints committed in the timeline the restart abandons


def coordinator(cfg, root: Path, store: SealedStore, events: list) -> CheckpointCoordinator:
    cfg = cfg.copy()
    cfg.checkpoint.dir = str(root)
    cfg.checkpoint.keep = 2
    return CheckpointCoordinator(
        cfg, root, store, 8, event=lambda kind, **fields: events.append((kind.value, fields)), extra={}
    )


def write_like_a_worker(store: SealedStore, root: Path, boundary: int, layers) -> None:
    """The shards of ``boundary`` written in the background and their records reported, as an old
    generation's writer does before it is stopped."""
    with AsyncCheckpointWriter(threads=2, timeout_s=WAIT_S) as writer:
        records = writer.submit(step_dir(root, boundary), writer.snapshot(layers)).result(WAIT_S)
    for layer, record in records.items():
        store.set(keys.checkpoint_shard(boundary, layer), json.dumps(record.to_dict()))


def ledger_with_commits(store: SealedStore, layers: int) -> StepLedger:
    """A ledger that has committed up to ROLLBACK and finds the commits of the steps after it,
    a checkpoint after steps 63 and 71, when it takes the step in flight (as a restart does)."""
    plan = hand_plan([(template([(0, layers, 0, 0, 1)]), (0,), 8)], batch=16, micro=2, layers=layers, f=0, gpus=1)
    ledger = StepLedger(store, 100, 16, on_step=lambda row: None)
    ledger.publish(0, Layout(plan, 1.0, "1 x 1"), 0)
    ledger.next_step = ROLLBACK
    for step in range(ROLLBACK, max(ZOMBIES)):
        store.set(keys.loss(0, step, 0), "1.0")
        store.set(keys.decision(0, step), keys.commit_decision(step + 1 in ZOMBIES, 0.01))
    assert ledger.take_in_flight() == max(ZOMBIES)
    assert [boundary for _, boundary in ledger.checkpoint_boundaries] == list(ZOMBIES)
    return ledger


def test_a_rollback_drops_the_checkpoints_of_the_steps_it_rolls_back(tmp_path, cfg, layers):
    store = SealedStore(dist.HashStore(), keys.KeySpace("race"))
    ledger = ledger_with_commits(store, len(layers))
    assert ledger.roll_back(ROLLBACK) == max(ZOMBIES) - ROLLBACK
    assert ledger.checkpoint_boundaries == []  # nothing of the abandoned timeline is checkpointed


def test_the_restart_s_checkpoint_outlives_the_zombie_checkpoints_that_complete(tmp_path, cfg, layers):
    root = tmp_path / "checkpoints"
    store = SealedStore(dist.HashStore(), keys.KeySpace("race"))
    events: list = []
    checkpoints = coordinator(cfg, root, store, events)
    for step in (48, ROLLBACK):
        checkpoints.adopt(step, save(root, step, layers, cfg))
    ledger = ledger_with_commits(store, len(layers))
    # The restart from ROLLBACK pins its checkpoint; the boundaries queued before the rollback are
    # handed to the coordinator as the old code did (the ledger fix alone would not queue them).
    checkpoints.pin(ROLLBACK)
    writers = {layer: (0, 0) for layer in range(len(layers))}
    for boundary in ZOMBIES:
        write_like_a_worker(store, root, boundary, layers)
        checkpoints.noticed(0, boundary, writers)
    assert checkpoints.poll() == list(ZOMBIES)
    assert [e.step for e in list_checkpoints(root)] == [ROLLBACK, *ZOMBIES]  # 48 went, 56 stayed
    assert read_manifest(step_dir(root, ROLLBACK)).step == ROLLBACK
    # The restart's workers load it (checksums verified), however late they come.
    fresh = restore_layers(
        step_dir(root, ROLLBACK),
        range(len(layers)),
        lambda index, committed: new_layer_state(cfg.model, cfg.job, index, 0, "cpu", committed),
        ROLLBACK,
    )
    assert all((fresh[i].flat == layers[i].flat).all() for i in range(len(layers)))
    # Once they hold it, retention may take it like any other.
    checkpoints.unpin(ROLLBACK)
    write_like_a_worker(store, root, 80, layers)
    checkpoints.noticed(0, 80, writers)
    assert checkpoints.poll() == [80]
    assert [e.step for e in list_checkpoints(root)] == [72, 80]
    assert ledger.next_step == max(ZOMBIES)
