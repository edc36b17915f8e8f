"""Planning: pipeline templates, instantiation, batch distribution and reconfiguration.

Pure Python (numpy at most): this package never imports torch.distributed, so the planner runs
the same in workers, the controller, the simulator and the CLI.

- ``pipeline_cost``: the cost model (Eq. 1-4, exact 1F1B makespan, memory, gradient sync);
- ``templates``: n0 and the exact template DP for every node count, from the stage table
  (``stage_table``), the seeds and least slowest stage (``bottleneck_search``), the DP at one
  bottleneck (``threshold_search``) and the sweep over bottlenecks (``threshold_sweep``), with the
  bounds that let it skip most of the search (``marker_bounds``, ``gpu_relaxation``, ``node_bounds``
  with ``node_geometry``, ``node_costs`` and ``prefix_bounds``);
- ``instantiate``: the choice of pipelines over live nodes (one pipeline count: ``count_search``),
  with exact batch distribution (``batch_distribution``) and gradient sync (``gradient_sync``);
- ``inputs`` / ``outputs``: what the planner takes (profile, cluster) and gives (templates, plans);
- ``reconfigure``: new pipelines, their node placement (``placement``) and layer copies
  (``layer_copies``) after failures or joins (regroup or re-plan, decided by the cost model;
  copies relayed down chains); the f check;
- ``horizon``: how many steps a new plan is expected to run (the regroup-or-re-plan horizon);
- ``synthetic``: seeded synthetic profiles for tests, benchmarks and the CLI.
"""

from oobleck.planning.horizon import mean_change_gap_s, replan_horizon_steps
from oobleck.planning.inputs import AllReduceSample, ClusterSpec, LayerProfile, ModelProfile
from oobleck.planning.instantiate import build_plan, distribute_microbatches, instantiate
from oobleck.planning.outputs import (
    ExecutionPlan,
    LayerTransfer,
    PipelineInstance,
    PipelineTemplate,
    ReconfigurationPlan,
    StageSpec,
    WorkerAssignment,
    tolerated_failures,
)
from oobleck.planning.pipeline_cost import (
    copy_seconds,
    exact_1f1b_makespan,
    pipeline_iteration_time,
    pipeline_time,
    stage_memory_bytes,
)
from oobleck.planning.reconfigure import check_fault_tolerance, plan_transfers, reconfigure
from oobleck.planning.synthetic import synthetic_profile
from oobleck.planning.templates import TemplateProgress, TemplateSet, generate_templates, min_nodes

__all__ = [
    "AllReduceSample",
    "ClusterSpec",
    "ExecutionPlan",
    "LayerProfile",
    "LayerTransfer",
    "ModelProfile",
    "PipelineInstance",
    "PipelineTemplate",
    "ReconfigurationPlan",
    "StageSpec",
    "TemplateProgress",
    "TemplateSet",
    "WorkerAssignment",
    "build_plan",
    "check_fault_tolerance",
    "copy_seconds",
    "distribute_microbatches",
    "exact_1f1b_makespan",
    "generate_templates",
    "instantiate",
    "mean_change_gap_s",
    "min_nodes",
    "pipeline_iteration_time",
    "pipeline_time",
    "plan_transfers",
    "reconfigure",
    "replan_horizon_steps",
    "stage_memory_bytes",
    "synthetic_profile",
    "tolerated_failures",
]
