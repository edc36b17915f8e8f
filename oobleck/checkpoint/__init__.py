"""Checkpoint storage: durable, by-layer checkpoints that any plan, node count or strategy resumes.

A checkpoint is a directory ``<checkpoint dir>/step-NNNNNNNN/`` with one shard per layer and a
manifest written last (``layout``). How the runtime uses it (``oobleck.elastic.checkpoints`` on
the controller, ``oobleck.runtime.checkpointing`` on the workers):

1. the controller picks the writer of each layer (``oobleck.checkpoint.assignment``) and
   publishes it with every generation; the rank that commits a step decides whether a checkpoint
   follows it (``checkpoint.every_steps``, or a request of the controller's);
2. each writer takes a ``snapshot`` of its layers at that step boundary and hands it to its
   ``AsyncCheckpointWriter``, which writes the shards in the background (``writer``, ``shard``);
3. once every shard's ``ShardRecord`` is reported, the controller writes the ``Manifest``
   (``manifest``) and applies retention (``catalog.prune``);
4. on resume, ``resolve_resume`` / ``resume_checkpoint`` find the newest valid checkpoint
   (``catalog``: checksums verified, corrupt or partial ones skipped and reported), check its
   ``fingerprint`` against the config, and workers ``restore_layer`` the layers they hold.

Modules: ``durable`` (atomic writes, fsync), ``layout`` (names), ``manifest``, ``shard`` (the shard
file format), ``writer`` (snapshot + background writes), ``catalog`` (list, verify, latest,
prune), ``fingerprint``, ``resume``, ``assignment`` (which holder writes each layer). Only
``shard`` and ``writer`` need torch: they load on first use (``from oobleck.checkpoint import
AsyncCheckpointWriter``), so the simulator and the planner use the torch-free parts without it.
"""

from typing import TYPE_CHECKING, Any

from oobleck.checkpoint.catalog import (
    Checkpoint,
    Search,
    Skipped,
    StepDir,
    find_latest,
    latest_valid,
    list_checkpoints,
    prepare_step_dir,
    prune,
    verify,
)
from oobleck.checkpoint.fingerprint import check_fingerprint, fingerprint
from oobleck.checkpoint.layout import checkpoint_root, shard_name, step_dir, step_of
from oobleck.checkpoint.manifest import Manifest, ShardRecord, read_manifest, write_manifest
from oobleck.checkpoint.resume import resolve_resume, resume_checkpoint

if TYPE_CHECKING:
    from oobleck.checkpoint.shard import Shard, ShardMeta, read_shard, restore_layer, shard_meta, write_shard
    from oobleck.checkpoint.writer import AsyncCheckpointWriter, Snapshot, WriteHandle, save_checkpoint, snapshot

_NEEDS_TORCH = {
    "oobleck.checkpoint.shard": ("Shard", "ShardMeta", "read_shard", "restore_layer", "shard_meta", "write_shard"),
    "oobleck.checkpoint.writer": ("AsyncCheckpointWriter", "Snapshot", "WriteHandle", "save_checkpoint", "snapshot"),
}


def __getattr__(name: str) -> Any:
    import importlib

    for module, names in _NEEDS_TORCH.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'oobleck.checkpoint' has no attribute {name!r}")


__all__ = [
    "AsyncCheckpointWriter",
    "Checkpoint",
    "Manifest",
    "Search",
    "Shard",
    "ShardMeta",
    "ShardRecord",
    "Skipped",
    "Snapshot",
    "StepDir",
    "WriteHandle",
    "check_fingerprint",
    "checkpoint_root",
    "find_latest",
    "fingerprint",
    "latest_valid",
    "list_checkpoints",
    "prepare_step_dir",
    "prune",
    "read_manifest",
    "read_shard",
    "resolve_resume",
    "restore_layer",
    "save_checkpoint",
    "resume_checkpoint",
    "shard_meta",
    "shard_name",
    "snapshot",
    "step_dir",
    "step_of",
    "verify",
    "write_manifest",
    "write_shard",
]
