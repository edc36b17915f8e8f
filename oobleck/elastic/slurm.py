"""Starting node agents on a Slurm allocation (``cluster.kind=slurm``).

The controller runs inside the batch script (on the allocation's first node); each agent is its
own job step, ``srun --nodes=1 --ntasks=1 --relative=<slot> --overlap``, so the agent for node id
``k`` runs on one node of the allocation and a node can be killed on its own: ``scancel
--signal=KILL <job>.<step>`` kills every process of that step (agent and workers) as a node crash
would; ``--signal=STOP`` freezes it. scancel reaches the step through slurmctld and slurmd, which
can take seconds on a busy cluster, while training goes on: so that an injected fault lands at the
step it names, the controller also has the node's agent signal its own process group at once
(``Launcher.signals_land_at_once``), and scancel reaches what the agent could not (a frozen node).
A freeze is the agent's alone: Slurm refuses ``--signal=STOP`` on a step of a multi-node allocation
("Invalid job id specified").
A join starts an agent on an allocation slot that no live
agent uses (a killed node's slot, or spare nodes requested beyond ``cluster.nodes``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from typing import Any

from oobleck.errors import RunError
from oobleck.launcher import Launcher

STEP_LOOKUP_TIMEOUT_S = 30.0
SLURM_COMMAND_TIMEOUT_S = 30.0
STEP_END_GRACE_S = 5.0  # how long a node's srun may take to exit after its step ended


class _StepEnded(RunError):
    """The node's step ended (its srun exited) before its step id was known."""

    def __init__(self, node: int) -> None:
        super().__init__(f"the Slurm step of node {node} ended")


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SLURM_COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RunError(f"{' '.join(command)} did not answer within {SLURM_COMMAND_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise RunError(f"{' '.join(command)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


class SlurmLauncher(Launcher):
    """Starts ``python -m oobleck.elastic.agent`` as one Slurm job step per node; kills and reaps them."""

    kind = "slurm"
    signals_land_at_once = False  # scancel: through slurmctld and slurmd
    controller_host = "this allocation's first node"
    gpu_hint = "request GPUs with sbatch --gpus-per-node=<g> (slurm/run.sbatch), or "

    def __init__(
        self,
        cluster: Any,
        controller: str,
        run_id: str,
        *,
        environment: Mapping[str, str] | None = None,
        fork_server: Any = None,
        job_environ: Mapping[str, str] | None = None,
    ) -> None:
        """``job_environ``: where the Slurm job's variables are read (default: this process's)."""
        env = dict(os.environ if job_environ is None else job_environ)
        self.check_environment(cluster, env)
        super().__init__(cluster, controller, run_id, environment=environment, fork_server=fork_server)
        self.job_id = env["SLURM_JOB_ID"]
        self.slots = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        self.slot_of: dict[int, int] = {}
        self.steps: dict[int, str] = {}

    @classmethod
    def check_environment(cls, cluster: Any, environ: Mapping[str, str] | None = None) -> None:
        """A Slurm run starts inside an allocation (``SLURM_JOB_ID``), with ``srun`` and ``scancel``."""
        env = os.environ if environ is None else environ
        if "SLURM_JOB_ID" not in env:
            raise RunError(
                "cluster=slurm must run inside a Slurm allocation (SLURM_JOB_ID is not set): submit it with "
                "sbatch slurm/run.sbatch <overrides>, or run it here with cluster=local"
            )
        if shutil.which("srun") is None or shutil.which("scancel") is None:
            raise RunError("cluster=slurm needs srun and scancel on PATH (install Slurm's client commands)")

    def _free_slot(self, node: int) -> int:
        used = {self.slot_of[n] for n, p in self.processes.items() if p.poll() is None}
        free = [slot for slot in range(self.slots) if slot not in used]
        if not free:
            raise RunError(
                f"no free node in Slurm job {self.job_id} for node id {node}: all {self.slots} allocated nodes "
                "run agents; request spare nodes for joins (sbatch -N <cluster.nodes + joins>)"
            )
        # Node id k prefers slot k, so a fresh run puts node k on the allocation's k-th node.
        return node if node in free else free[0]

    def _step_name(self, node: int) -> str:
        return f"oobleck-{self.run_id}-node{node}"

    def start(self, node: int) -> None:
        slot = self._free_slot(node)
        command = [
            "srun",
            f"--jobid={self.job_id}",
            "--nodes=1",
            "--ntasks=1",
            f"--relative={slot}",
            "--overlap",
            "--kill-on-bad-exit=0",
            f"--job-name={self._step_name(node)}",
            "--quiet",
            *self.agent_command(node),
        ]
        self.processes[node] = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=self.agent_environment())
        self.slot_of[node] = slot

    def _step_id(self, node: int) -> str:
        """The ``<job>.<step>`` of node's agent (looked up once, bounded)."""
        if node in self.steps:
            return self.steps[node]
        name = self._step_name(node)
        deadline = time.monotonic() + STEP_LOOKUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.processes[node].poll() is not None:
                raise _StepEnded(node)
            for line in _run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"]).splitlines():
                step, _, step_name = line.strip().partition(" ")
                if step_name == name:
                    self.steps[node] = step
                    return step
            time.sleep(0.2)
        raise RunError(
            f"the Slurm step of node {node} ({name}) did not appear in squeue within {STEP_LOOKUP_TIMEOUT_S:.0f} s"
        )

    def send_signal(self, node: int, sig: int) -> None:
        """Deliver ``sig`` to every process of node's step (SIGSTOP freezes the node)."""
        process = self.processes.get(node)
        if process is None or process.poll() is not None:
            return
        try:
            _run(["scancel", f"--signal={signal.Signals(sig).name.removeprefix('SIG')}", self._step_id(node)])
        except _StepEnded:
            return  # its agent signalled its own process group first (``signals_land_at_once``)
        except RunError as refused:
            try:  # a step that ended while scancel ran is refused as "completed": nothing left to signal
                process.wait(timeout=STEP_END_GRACE_S)
            except subprocess.TimeoutExpired:
                raise refused from None
