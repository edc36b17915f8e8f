"""The TCPStore key space shared by the controller and the workers (no torch import here).

Everything the control plane and the workers say to each other goes through these keys, so the
protocol can be read in one place:

- ``config`` (JSON of the resolved run config), ``services`` (JSON: what the strategy's run-long
  services publish, e.g. torchft's lighthouse address), ``gen`` (the newest generation number),
  ``plan/<g>`` (the ``PlanDocument`` of generation g, ``oobleck.runtime.plan_document``: its plan,
  its reconfiguration, the step to resume at, ...; a typed value validated where it is read);
- ``abort/<g>``: generation g is over (a newer one exists, or the run stops: then ``stop`` holds why);
- ``g<g>/decision/<s>``: the commit decision of step s in generation g, "commit <seconds>" (or
  "commit+checkpoint <seconds>": commit, then every layer's writer checkpoints the state after
  step s; the seconds are the step's time on the deciding rank) or "abort", taken atomically with
  ``compare_set`` by whichever comes first: the last rank to finish its gradient all-reduce, or
  the controller aborting the generation (``commit_decision``, ``decision_kind``);
- ``checkpoint/request``: the controller asks for a checkpoint at the first step boundary at or
  after the step it holds (the rank deciding that commit takes and deletes it);
  ``checkpoint/<b>/<layer>``: a written shard's record (JSON), ``checkpoint/<b>/timing/<node>/<rank>``;
- ``g<g>/established``: "yes" once every rank of g built its groups and received its layers,
  "no" when the controller aborted g first (same compare_set race, so both sides agree which
  plan owns the layers);
- per-rank reports: losses, timings, checksums; per-worker registration and errors;
- ``g<g>/step_report/<s>``: a worker's own account of committed step s (JSON), set before its
  decision by workers whose replicas change without a new generation (torchft's): it replaces the
  per-rank losses of the plan (see ``step_report``).
- ``hb/<node>/<rank>/<incarnation>``: a worker's heartbeat (``oobleck.runtime.liveness``): a counter
  and what the worker is waiting on, so the controller catches a frozen worker and the ranks that
  never answered a collective.

Trust: anyone who can connect to the store can read and write every key (torch's TCPStore has no
authentication, and ``list_keys`` shows them all), so the store listens only on
``cluster.master_addr`` (loopback for local runs). The values whose forgery would take a node
down or end the run from outside (``strike/<node>``, ``stop``) and the heartbeats are *signed* with
the run's secret (``SECRET_ENV``, which the launcher hands the agents and they pass on to their
workers): a value that does not verify is ignored.
"""

from __future__ import annotations

import hashlib
import hmac

CONFIG = "config"
GEN = "gen"
SERVICES = "services"
STOP = "stop"
COMMIT = "commit"
COMMIT_CHECKPOINT = "commit+checkpoint"
ABORT = "abort"
CHECKPOINT_REQUEST = "checkpoint/request"
YES = "yes"
NO = "no"
SECRET_ENV = "OOBLECK_AGENT_SECRET"  # the run's secret, in every agent's and worker's environment
_MAC_CHARS = 32  # 128 bits of HMAC-SHA256, hex


def sign(secret: str, text: str) -> str:
    """``text`` with a MAC under the run's secret (``verified`` gives it back)."""
    mac = hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()[:_MAC_CHARS]
    return f"{mac}:{text}"


def verified(secret: str, value: bytes | str) -> str | None:
    """The text of a value ``sign`` made with ``secret``; None for anything else (a forgery)."""
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            return None
    mac, sep, text = value.partition(":")
    if not sep or not secret:
        return None
    expected = hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()[:_MAC_CHARS]
    return text if hmac.compare_digest(mac, expected) else None


def plan(generation: int) -> str:
    return f"plan/{generation}"


def abort(generation: int) -> str:
    return f"abort/{generation}"


def prefix(generation: int) -> str:
    """PrefixStore prefix of every process group of a generation."""
    return f"g{generation}"


def decision(generation: int, step: int) -> str:
    return f"g{generation}/decision/{step}"


def commit_decision(checkpoint: bool, step_time_s: float) -> str:
    """The decision value that commits a step (with a checkpoint after it, or not), carrying the
    seconds the step took on the rank that decided it (the last to finish its reduction), so one
    store operation both decides the step and reports its time."""
    return f"{COMMIT_CHECKPOINT if checkpoint else COMMIT} {step_time_s!r}"


def decision_kind(value: str) -> str:
    """``COMMIT``, ``COMMIT_CHECKPOINT`` or ``ABORT`` of a decision value."""
    return value.partition(" ")[0]


def decision_step_time(value: str) -> float | None:
    """The step time a commit decision carries (None: it carries none)."""
    _, _, seconds = value.partition(" ")
    return float(seconds) if seconds else None


def is_commit(value: str) -> bool:
    """Whether a decision value commits its step (with or without a checkpoint after it)."""
    return decision_kind(value) in (COMMIT, COMMIT_CHECKPOINT)


def step_report(generation: int, step: int) -> str:
    """One JSON account of committed step s, written before its decision: ``loss_sum`` (summed over
    the samples trained), ``samples``, optionally ``nodes``/``pipelines``/``attempts``/``step_time_s``
    and any further fields, which become columns of metrics.csv. When present, the ledger takes
    it instead of summing the plan's per-rank ``loss`` keys."""
    return f"g{generation}/step_report/{step}"


def checkpoint_shard(boundary: int, layer: int) -> str:
    """The record of layer's shard in the checkpoint of ``boundary`` committed steps."""
    return f"checkpoint/{boundary}/{layer}"


def checkpoint_timing(boundary: int, node: int, local_rank: int) -> str:
    """A writer's snapshot and write seconds for that checkpoint (JSON)."""
    return f"checkpoint/{boundary}/timing/{node}/{local_rank}"


def commit_count(generation: int, step: int) -> str:
    return f"g{generation}/commits/{step}"


def loss(generation: int, step: int, rank: int) -> str:
    return f"g{generation}/loss/{step}/{rank}"


def ready_count(generation: int) -> str:
    return f"g{generation}/ready"


def established(generation: int) -> str:
    return f"g{generation}/established"


def timing(generation: int, rank: int) -> str:
    return f"g{generation}/timing/{rank}"


def checksums(generation: int, rank: int) -> str:
    return f"g{generation}/checksums/{rank}"


def worker_registered(node: int, local_rank: int, incarnation: int = 0) -> str:
    """Set by a worker process once it is up; ``incarnation`` counts the node's worker restarts."""
    return f"worker/{node}/{local_rank}/{incarnation}"


def worker_error(node: int, local_rank: int, incarnation: int) -> str:
    """The traceback of a worker that raised; per incarnation, so an older process's error is never
    read as a newer one's."""
    return f"error/{node}/{local_rank}/{incarnation}"


def strike(node: int) -> str:
    """An armed fault for a node: signed JSON {step, phase, kind} (oobleck.faults.kinds); the node's local rank 0 fires it."""
    return f"strike/{node}"


def strike_time(node: int) -> str:
    return f"strike_time/{node}"


def probe(generation: int, rank: int) -> str:
    """A worker's resource counts (threads, fds, RSS, live groups) after establishing a generation."""
    return f"g{generation}/probe/{rank}"


def final_params(layer: int) -> str:
    """A layer's parameters after the last step (``runtime.save_final_params``), from one holder."""
    return f"final/{layer}"


def work(generation: int, step: int, rank: int) -> str:
    """The compute ops a rank ran in step s (JSON, set before its commit vote when
    ``runtime.record_work``): the work ledger, which shows every sample processed once."""
    return f"g{generation}/work/{step}/{rank}"


def phase_times(node: int, local_rank: int) -> str:
    """A worker's seconds spent per step phase over the whole run (published when it finishes)."""
    return f"phases/{node}/{local_rank}"


def heartbeat(node: int, local_rank: int, incarnation: int) -> str:
    """A worker's signed heartbeat (JSON, ``oobleck.runtime.liveness.Liveness``)."""
    return f"hb/{node}/{local_rank}/{incarnation}"
