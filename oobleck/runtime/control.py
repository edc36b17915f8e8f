"""A worker's waits on the control plane: what the controller and the generation's ranks decide in the store.

- ``next_generation``: the newest plan after the one this worker left (a worker a plan does not
  use sits generations out), or None once the run stops;
- ``wait_world``: a barrier every rank of the generation takes part in (``established``); past the
  collective timeout the controller fails the ranks that did not answer, so the wait lasts the
  timeout and the waiter's grace;
- ``decide``: the commit decision of a step, proposed by the last rank to vote and read by the
  others; a decision the run did not write is never acted on.

Every wait is marked in the worker's heartbeat (``oobleck.runtime.liveness``), so the controller
sees what it waits for.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from oobleck.errors import RunError
from oobleck.runtime import keys
from oobleck.runtime.entry import stop_requested
from oobleck.runtime.liveness import Liveness
from oobleck.runtime.sealed_store import ForeignValue, SealedStore
from oobleck.runtime.waits import Waiter


class ControlWaits:
    """One worker's waits on the controller's store (see the module docstring)."""

    def __init__(self, store: SealedStore, liveness: Liveness, waiter: Waiter, timeout_s: float, wait_s: float) -> None:
        self.store = store
        self.liveness = liveness
        self.waiter = waiter
        self.timeout_s = timeout_s  # cluster.collective_timeout_s
        self.wait_s = wait_s  # cluster.startup_timeout_s

    def _wait_key(self, key: str, timeout_s: float, what: str) -> None:
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except Exception as error:
            raise _timed_out(timeout_s, what, key) from error

    def wait_world(self, key: str, what: str) -> None:
        """Wait for a decision every rank of the generation takes part in; past the collective
        timeout the controller fails the ranks that did not answer (and aborts), so wait for it."""
        with self.liveness.waiting(what):
            self._wait_key(key, self.timeout_s + self.waiter.peer_grace_s, what)

    def _get_world(self, key: str, what: str) -> bytes:
        """``wait_world``, then the key's value, in one store operation (a get waits for its key)."""
        timeout_s = self.timeout_s + self.waiter.peer_grace_s
        default = self.store.timeout
        self.store.set_timeout(timedelta(seconds=timeout_s))
        try:
            with self.liveness.waiting(what):
                return self.store.get(key)
        except dist.DistStoreError as error:
            raise _timed_out(timeout_s, what, key) from error
        finally:
            self.store.set_timeout(default)

    def _stopped(self) -> bool:
        return stop_requested(self.store)

    def next_generation(self, after: int | None) -> int | None:
        """The newest generation after ``after`` (None: at start-up); None when the run stops."""
        if after is None:
            self._wait_key(keys.GEN, self.wait_s, "the first plan")
            after = int(self.store.get(keys.GEN))
            # A restarted worker may find the generation its predecessors were aborted in: it
            # waits for the next one like everybody else.
            if not self.store.check([keys.abort(after)]):
                return None if self._stopped() else after
        # A worker may sit out generations (a plan that does not use it): wait as long as the
        # run lives, in bounded slices so a vanished controller still ends the wait. A worker of
        # the generation that left it (an abort it read) says so in its heartbeat: if the
        # controller never ended that generation, it publishes the next one (Membership.stranded).
        with self.liveness.awaiting(after + 1):
            while True:
                try:
                    self.store.wait([keys.abort(after)], timedelta(seconds=self.wait_s))
                    break
                except Exception:
                    if self._stopped():
                        return None
            if self._stopped():
                return None
            self._wait_key(keys.plan(after + 1), self.wait_s, f"the plan of generation {after + 1}")
        if self._stopped():
            return None
        newest = self.store.read(keys.GEN, keys.parse_step)
        return newest if isinstance(newest, int) and newest > after else after + 1

    def decide(self, generation: int, step: int, world: int, every_steps: int, step_s: float) -> str:
        """The commit decision of ``step``: the last rank to vote proposes it (``compare_set`` hands
        it the decision that stands: the controller's abort may have come first), the others read
        it. A decision the run did not write, or cannot parse, is never acted on: this rank waits
        for the controller, which aborts the generation and has the step redone."""
        what = f"the commit decision of step {step}"
        key = keys.decision(generation, step)
        try:
            if self.store.add(keys.commit_count(generation, step), 1) == world:
                proposal = keys.commit_decision(self._checkpoint_after(step + 1, every_steps), step_s)
                decision = self.store.compare_set(key, "", proposal).decode()
            else:
                decision = self._get_world(key, what).decode()
            keys.parse_decision(decision)
        except (ForeignValue, ValueError) as error:
            with self.liveness.waiting(what):
                self.waiter.await_abort(what, error)
        return decision

    def _checkpoint_after(self, boundary: int, every_steps: int) -> bool:
        """Whether the commit this rank decides for the step ending at ``boundary`` committed steps
        has a checkpoint after it: every ``every_steps``, or when the controller asked for one (a
        request the run did not write, or not a step, is dropped)."""
        if every_steps > 0 and boundary % every_steps == 0:
            return True
        requested = self.store.read(keys.CHECKPOINT_REQUEST, keys.parse_step)
        if isinstance(requested, int) and boundary >= requested:
            self.store.delete_key(keys.CHECKPOINT_REQUEST)
            return True
        return False


def _timed_out(timeout_s: float, what: str, key: str) -> RunError:
    return RunError(f"timed out after {timeout_s} s waiting for {what} (store key {key!r})")
