"""The plan document: what the controller publishes per generation, typed and validated on read."""

from __future__ import annotations

import dataclasses
import json

import pytest

from oobleck.planning.outputs import LayerTransfer, ReconfigurationPlan
from oobleck.runtime.plan_document import CheckpointPlan, PlanDocument, PlanDocumentError
from testing import two_pipelines_of_two_nodes


def document(**changes) -> PlanDocument:
    plan = two_pipelines_of_two_nodes()
    fields = {
        "generation": 3,
        "plan": plan,
        "resume_step": 7,
        "checkpoint": CheckpointPlan("/tmp/ckpt", 5, {0: (0, 0), 1: (1, 0)}),
        "reconfiguration": ReconfigurationPlan(plan, plan, (2,), (), (LayerTransfer(1, (0, 0), (1, 0), 0, 1, 64),)),
        "load_checkpoint": None,
        "incarnations": {0: 0, 1: 2},
    }
    fields.update(changes)
    return PlanDocument(**fields)


def test_a_document_reads_back_as_written():
    written = document()
    read = PlanDocument.from_json(written.to_json().encode())  # the store hands back bytes
    assert read == written
    assert read.incarnation(1) == 2 and read.incarnation(9) == 0
    assert read.checkpoint.layers_written_by((1, 0)) == [1] and read.checkpoint.writers[0] == (0, 0)
    assert (
        PlanDocument.from_json(document(reconfiguration=None, load_checkpoint="/x").to_json()).load_checkpoint == "/x"
    )


def test_fields_with_defaults_may_be_absent():
    data = json.loads(document().to_json())
    for name in ("reconfiguration", "load_checkpoint", "incarnations"):
        del data[name]
    read = PlanDocument.from_json(json.dumps(data))
    assert read.reconfiguration is None and read.load_checkpoint is None and read.incarnations == {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("resume_step"), "plan/3 has no field 'resume_step'"),
        (lambda d: d.update(resume_step="7"), "plan/3.resume_step must be int, not '7'"),
        (lambda d: d.update(resume_step=True), "plan/3.resume_step must be int, not True"),
        (lambda d: d.update(incarnations={"a": 1}), "plan/3.incarnations key must be an integer, not 'a'"),
        (lambda d: d["checkpoint"].update(writers={"0": [0]}), "plan/3.checkpoint.writers[0] must be a list of 2"),
        (lambda d: d.update(plan={"pipelines": 1}), "plan/3.plan is not a valid ExecutionPlan"),
        (lambda d: d.update(schedule="zb"), "plan/3 has fields ['schedule'] that PlanDocument does not know"),
        (lambda d: d.update(checkpoint=None), "plan/3.checkpoint must be an object (CheckpointPlan), not None"),
    ],
)
def test_a_malformed_document_is_one_clear_error(change, message):
    data = json.loads(document().to_json())
    change(data)
    with pytest.raises(PlanDocumentError) as error:
        PlanDocument.from_json(json.dumps(data))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_document_that_is_not_json_is_one_clear_error():
    with pytest.raises(PlanDocumentError, match="a plan document is not JSON"):
        PlanDocument.from_json(b"{not json")


def test_a_new_field_is_one_line():
    """What another part adds to the document (a schedule mode, say) round-trips with no codec code."""

    @dataclasses.dataclass(frozen=True)
    class Extended(PlanDocument):
        schedule: str = "1f1b"
        reroute: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    base = {f.name: getattr(document(), f.name) for f in dataclasses.fields(PlanDocument)}
    written = Extended(**base, schedule="zero_bubble", reroute={2: (0, 1)})
    assert Extended.from_json(written.to_json()) == written
    assert Extended.from_json(document().to_json()).schedule == "1f1b"  # written before the field existed
