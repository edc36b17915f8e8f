"""What must match between the run that wrote a checkpoint and the run that resumes from it.

Resuming must continue the same training exactly: the same model (every ``model.*`` key), the
same data (``job.dataset``; for the shipped corpus its file name, size and SHA-256, for synthetic
data the sample count), the same step-indexed batches (``job.global_batch_size``, ``job.seed``)
and the same optimiser and LR schedule (``job.lr, min_lr, warmup_steps, steps, weight_decay,
beta1, beta2, grad_clip``). Free to differ: ``job.microbatch_size``, the node count, the plan and
the strategy, because shards are by layer and a step's gradient does not depend on the layout.
Torch-free.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from oobleck.errors import ConfigError
from oobleck.schema import to_container

# Path of the shipped corpus (the same file oobleck.data.dataset reads), found without torch.
CORPUS_PATH = Path(__file__).resolve().parents[1] / "data" / "corpus" / "python_reference.txt"
JOB_KEYS = (
    "dataset",
    "global_batch_size",
    "seed",
    "lr",
    "min_lr",
    "warmup_steps",
    "steps",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
)


@functools.lru_cache(maxsize=4)
def _file_identity(path: str) -> tuple[str, int, str]:
    data = Path(path).read_bytes()
    return Path(path).name, len(data), hashlib.sha256(data).hexdigest()


def fingerprint(cfg: Any, corpus_path: Path = CORPUS_PATH) -> dict[str, Any]:
    """Flat ``{"model.n_layer": 4, "job.seed": 0, "data.corpus_sha256": ..., ...}`` of ``cfg``."""
    data = to_container(cfg)
    result: dict[str, Any] = {f"model.{key}": value for key, value in sorted(data["model"].items())}
    job = data["job"]
    result.update({f"job.{key}": job[key] for key in JOB_KEYS})
    if job["dataset"] == "synthetic":
        result["job.synthetic_samples"] = job["synthetic_samples"]
    else:
        name, size, digest = _file_identity(str(corpus_path))
        result.update({"data.corpus": name, "data.corpus_bytes": size, "data.corpus_sha256": digest})
    return result


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], source: Path | str | None = None) -> None:
    """Raise one ``ConfigError`` naming every key whose value differs (both values) and the fix."""
    absent = "<absent>"
    differing = sorted(key for key in set(saved) | set(current) if saved.get(key, absent) != current.get(key, absent))
    if not differing:
        return
    changes = "; ".join(
        f"{key}={saved.get(key, absent)!r} in the checkpoint, {current.get(key, absent)!r} now" for key in differing
    )
    overrides = " ".join(f"{key}={saved[key]}" for key in differing if key in saved and not key.startswith("data."))
    same = f"the checkpoint's settings ({overrides})" if overrides else "the checkpoint's settings"
    data_note = (
        " (data.* identify the shipped corpus file, which changed)"
        if any(k.startswith("data.") for k in differing)
        else ""
    )
    raise ConfigError(
        f"cannot resume from {source or 'the checkpoint'}: it was written by a different training setup: "
        f"{changes}{data_note}. Resume with {same}, or start fresh (a new run dir or checkpoint.dir, or job.resume=null)"
    )
