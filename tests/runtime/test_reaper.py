"""``Reaper``: abandoned process groups are dropped once their works are done, or at their deadline.

The worker's resource probe reports ``Reaper.overdue_s`` and the chaos suite bounds it: an item
left parked long past its deadline is what a leak of groups looks like."""

from __future__ import annotations

import gc
import threading
import time
import weakref

from oobleck.runtime.reaper import Reaper

WAIT_S = 10.0  # a bound on waits for the reaper's thread, not a timing assertion


class Group:
    """Stands for a process group: only whether it is still referenced matters here."""


class PendingWork:
    """A work on a peer that may never answer: completed only when the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def is_completed(self) -> bool:
        return self.done.is_set()


def wait_dropped(ref: weakref.ref) -> bool:
    deadline = time.monotonic() + WAIT_S
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return ref() is None


def park_one(reaper: Reaper, work: PendingWork) -> weakref.ref:
    group = Group()
    reaper.park([group], [work])
    return weakref.ref(group)


def test_a_group_whose_works_completed_is_dropped_before_its_deadline():
    reaper = Reaper(delay_s=3600.0, poll_s=0.01)
    work = PendingWork()
    ref = park_one(reaper, work)
    assert reaper.parked() == 1 and reaper.overdue_s() == 0.0
    work.done.set()
    assert wait_dropped(ref)
    assert reaper.parked() == 0


def test_a_group_whose_works_never_complete_is_dropped_at_its_deadline():
    reaper = Reaper(delay_s=0.2, poll_s=0.01)
    ref = park_one(reaper, PendingWork())
    assert wait_dropped(ref)
    assert reaper.parked() == 0 and reaper.overdue_s() == 0.0


def test_overdue_measures_how_late_the_oldest_item_is():
    reaper = Reaper(delay_s=0.05, poll_s=3600.0)  # its thread never wakes during the test
    park_one(reaper, PendingWork())
    time.sleep(0.25)
    assert reaper.parked() == 1 and reaper.overdue_s() >= 0.2
