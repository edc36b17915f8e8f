"""Trace parsing: the shipped traces, name resolution, and one clear error per malformed line."""

from __future__ import annotations

from pathlib import Path

import pytest

from oobleck.errors import TraceError
from oobleck.faults.trace import TRACES_DIR, load_trace, parse_trace, shipped_traces


def test_every_shipped_trace_loads_and_matches_its_readme():
    names = shipped_traces()
    assert {"synthetic/10m", "synthetic/6h", "spot/ec2_p3_scaled", "spot/gcp_a2_scaled"} <= set(names)
    for name in names:
        trace = load_trace(name)
        assert trace.name == name
        assert [e.time_ms for e in trace.events] == sorted(e.time_ms for e in trace.events)
    ten = load_trace("synthetic/10m")
    assert len(ten.initial_nodes()) == 30 and ten.removals() == 15 and ten.additions() == 30
    gaps = {b.time_ms - a.time_ms for a, b in zip(ten.changes()[1:], ten.changes()[2:])}
    assert gaps == {601_200}  # one removal every ~10 minutes (the artifact's spacing)
    sizes = [len(nodes) for _, nodes in ten.membership()]
    assert sizes == list(range(30, 14, -1))
    ec2 = load_trace("spot/ec2_p3_scaled")
    assert 15 <= min(len(n) for _, n in list(ec2.membership())[1:]) and ec2.max_nodes() == 30
    assert (TRACES_DIR / "README.md").is_file()


def test_name_resolution_accepts_suffix_and_paths(tmp_path: Path):
    assert load_trace("synthetic/1h.csv").events == load_trace("synthetic/1h").events
    file = tmp_path / "mine.csv"
    file.write_text("# comment\n0,add,a\n0,add,b\n\n5000,remove,a\n7000,add,c\n")
    trace = load_trace(str(file))
    assert trace.name == "mine"
    assert [(c.time_ms, c.added, c.removed) for c in trace.changes()] == [
        (0, ("a", "b"), ()),
        (5000, (), ("a",)),
        (7000, ("c",), ()),
    ]
    assert list(trace.membership())[-1] == (7000, ("b", "c"))
    assert trace.events[2].line == 5  # comments and blank lines still count as lines


def test_same_instant_add_and_remove_nets_out():
    trace = parse_trace("0,add,a\n0,add,b\n9,add,c\n9,remove,c\n9,remove,b\n9,add,b\n", origin="t.csv")
    assert [(c.time_ms, c.added, c.removed) for c in trace.changes()] == [(0, ("a", "b"), ()), (9, ("b",), ("b",))]
    assert list(trace.membership())[-1] == (9, ("a", "b"))
    # The shipped EC2 trace has such an instant (node156 at 39,960 s): it must not linger.
    ec2 = load_trace("spot/ec2_p3_scaled")
    assert all("node156" not in c.added for c in ec2.changes() if c.time_ms == 39_960_000)


def test_unknown_name_lists_the_shipped_traces():
    with pytest.raises(TraceError, match="synthetic/10m"):
        load_trace("synthetic/7m")


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("0,add,a\n1,add\n", 2, "expected 'time_ms,add|remove,node_name'"),
        ("0,add,a\nsoon,add,b\n", 2, "not an integer"),
        ("0,add,a\n-5,add,b\n", 2, "negative"),
        ("0,add,a\n10,add,b\n5,add,c\n", 3, "earlier than the previous"),
        ("0,add,a\n1,kill,a\n", 2, "'add' or 'remove'"),
        ("0,add,a\n1,add,\n", 2, "empty node name"),
        ("0,add,a\n1,add,a\n", 2, "already present"),
        ("0,add,a\n1,remove,b\n", 2, "not present"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path: Path, text: str, line: int, fragment: str):
    file = tmp_path / "bad.csv"
    file.write_text(text)
    with pytest.raises(TraceError) as info:
        load_trace(file)
    message = str(info.value)
    assert f"{file}:{line}:" in message and fragment in message


def test_empty_trace_is_an_error():
    with pytest.raises(TraceError, match="no events"):
        parse_trace("# nothing\n\n", origin="empty.csv")
