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
  ``checkpoint/<b>/<layer>``: a written shard's record (JSON), or ``{"layer", "failed": cause}``
  when its writer could not write it; ``checkpoint/<b>/timing/<node>/<rank>``;
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

Trust (``KeySpace``): anyone who can connect to the store can read and write any key (torch's
TCPStore has no authentication, and ``list_keys`` shows every key that exists), so the store
listens only on ``cluster.master_addr`` (loopback for local runs), and every key above is only the
*logical* name of a key. On the store each key is stored under a name derived from the run's
secret (``SECRET_ENV``, which the launcher hands the agents and they pass on to their workers):
``<logical name>@<HMAC tag>``. A client without the secret cannot name a key before the run
writes it, so it can neither pre-empt a ``compare_set`` (a decision, ``established``) nor set a
key the run waits for (``abort/<g>``, a registration, a plan). Every value is sealed with a MAC
over its key's name and the value (``seal``), so a value cannot be forged nor replayed under
another key; a value that does not verify is dropped where it is read (one log line).

What this does not cover: a client that lists the store's keys sees the names of the keys that
exist and can overwrite their values (or delete them) after the run wrote them, or add to the
counters (``add``), whose values are plain integers. A reader then drops the value it cannot
verify; the one such value that cannot simply be re-read is a commit decision overwritten between
two workers' reads (see ``oobleck.elastic.ledger``). Torch's own rendezvous keys of a
generation's process groups live under the generation's hidden prefix (``KeySpace.name`` of
``prefix(g)``) and are not sealed. Anyone who can read the agents' environment (root, the same
user) has the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from oobleck.errors import RunError

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


_NAME_TAG_CHARS = 20  # 80 bits of HMAC-SHA256 in a key's name: not guessable, short in list_keys
_SEAL_CHARS = 32  # 128 bits of HMAC-SHA256 before every value
_NAME_DOMAIN = b"oobleck key name\0"
_VALUE_DOMAIN = b"oobleck key value\0"


class KeySpace:
    """The run's key names and value seals, derived from the run's secret (see "Trust" above).

    ``name(key)`` is the name a logical key has on the store; ``seal(key, value)`` the bytes
    stored for a value; ``unseal(key, stored)`` the value back, or None when the bytes were not
    sealed for this key with this secret (a foreign or replayed value).
    """

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError(f"a key space needs the run's secret (the launcher hands it over in {SECRET_ENV})")
        self._secret = secret.encode()

    @classmethod
    def from_environment(cls) -> KeySpace:
        """The key space of the run this process belongs to (a worker: its agent handed the secret down)."""
        secret = os.environ.get(SECRET_ENV, "")
        if not secret:
            raise RunError(
                f"{SECRET_ENV} is not set: a worker reads the run's secret from its agent; start workers through "
                "python -m oobleck.elastic.agent (oobleck-run does)"
            )
        return cls(secret)

    def _mac(self, *parts: bytes) -> str:
        return hmac.new(self._secret, b"".join(parts), hashlib.sha256).hexdigest()

    def name(self, key: str) -> str:
        return f"{key}@{self._mac(_NAME_DOMAIN, key.encode())[:_NAME_TAG_CHARS]}"

    def seal(self, key: str, value: str | bytes) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(_VALUE_DOMAIN, key.encode(), b"\0", data)[:_SEAL_CHARS].encode() + b":" + data

    def unseal(self, key: str, stored: bytes | str) -> bytes | None:
        raw = stored.encode() if isinstance(stored, str) else bytes(stored)
        mac, sep, data = raw.partition(b":")
        if not sep or len(mac) != _SEAL_CHARS:
            return None
        expected = self._mac(_VALUE_DOMAIN, key.encode(), b"\0", data)[:_SEAL_CHARS].encode()
        return data if hmac.compare_digest(mac, expected) else None


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


def parse_decision(value: str | bytes) -> tuple[str, float | None]:
    """``(kind, step seconds)`` of a decision value: ``COMMIT`` or ``COMMIT_CHECKPOINT`` with the
    seconds the step took (finite, >= 0), or ``ABORT`` with None. Anything else is a ``ValueError``
    naming the value (a malformed value is dropped where it is read, never acted on)."""
    text = value.decode() if isinstance(value, bytes) else value
    kind, _, seconds = text.partition(" ")
    if kind == ABORT and not seconds:
        return ABORT, None
    if kind in (COMMIT, COMMIT_CHECKPOINT):
        step_s = float(seconds)  # ValueError for "xyz"
        if step_s == step_s and 0.0 <= step_s < float("inf"):
            return kind, step_s
    raise ValueError(f"not a decision value: {text[:80]!r}")


def decision_kind(value: str) -> str:
    """``COMMIT``, ``COMMIT_CHECKPOINT`` or ``ABORT`` of a decision value (``ValueError`` if it is none)."""
    return parse_decision(value)[0]


def decision_step_time(value: str) -> float | None:
    """The step time a commit decision carries (None for an abort)."""
    return parse_decision(value)[1]


def is_commit(value: str) -> bool:
    """Whether a decision value commits its step (with or without a checkpoint after it)."""
    return decision_kind(value) in (COMMIT, COMMIT_CHECKPOINT)


def parse_step(value: str | bytes) -> int:
    """A step number (or a count of committed steps) a value holds: an integer >= 0 (``ValueError``
    otherwise, e.g. for ``checkpoint/request = "garbage"``)."""
    step = int(value)
    if step < 0:
        raise ValueError(f"not a step: {step}")
    return step


def step_report(generation: int, step: int) -> str:
    """One JSON account of committed step s, written before its decision: ``loss_sum`` (summed over
    the samples trained), ``samples``, optionally ``nodes``/``pipelines``/``attempts``/``step_time_s``
    and any further fields, which become columns of metrics.csv. When present, the ledger takes
    it instead of summing the plan's per-rank ``loss`` keys."""
    return f"g{generation}/step_report/{step}"


def checkpoint_shard(boundary: int, layer: int) -> str:
    """The record of layer's shard in the checkpoint of ``boundary`` committed steps (JSON), or why
    its writer could not write it (``{"layer": l, "failed": "OSError ENOSPC: ..."}``)."""
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
    """An armed fault for a node: JSON {step, phase, kind} (oobleck.faults.kinds); the node's local rank 0 fires it."""
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
    """A worker's heartbeat (JSON, ``oobleck.runtime.liveness.Liveness``)."""
    return f"hb/{node}/{local_rank}/{incarnation}"
