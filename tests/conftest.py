"""Shared test helpers: composing the project's Hydra config the way the entry points do."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from testing.configs import composed

REPO = Path(__file__).resolve().parents[1]
# Measured profiles of the test runs stay in the checkout (gitignored) rather than in the user's
# ~/.cache/oobleck, shared by every test session and the subprocesses the tests start.
os.environ.setdefault("OOBLECK_CACHE_DIR", str(REPO / ".oobleck_cache"))


def pytest_configure(config):
    """Ctrl-C as in a terminal, however the suite was started.

    A command a non-interactive shell starts in the background (``cmd &``, ``nohup``, some CI
    runners) inherits SIGINT ignored, and every process the suite starts inherits it in turn: a
    test that presses Ctrl-C on an entry point would then wait for a reaction that never comes.
    Runs in pytest's own process and in each xdist worker (both call this hook).
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def make_config():
    """``compose_config``, each distinct composition done once per test process (``composed``)."""
    return composed


class _SharedForkServer:
    """One fork server (``oobleck.elastic.forkserver``) for every in-process run of a test session.

    A run that forks its workers starts a server that imports torch (3-5 s of CPU, more than a
    short run's training), and the suite starts dozens of such runs in-process. Handed
    this one instead, a run forks its workers from a server that is already up; ``close`` is the
    run's, so it does nothing: the server ends with the session. Every run still forks real
    workers into its own agents' process groups, tagged with its own run id; the per-run
    server's own life (start, exit when the launcher dies, reaping) is tested in
    tests/elastic/test_forkserver.py, and the command line (``python -m oobleck.run``, tests
    that run it as a subprocess) still starts one per run.
    """

    def __init__(self) -> None:
        self.server = None

    def for_run(self, cfg, run_id: str, *, from_this_process: bool = False):
        """``fork_server_for``'s stand-in; the shared server is exec'd (xdist's workers run threads)
        whatever ``from_this_process`` says."""
        from oobleck.elastic.forkserver import ForkServer, forks_workers

        if not forks_workers(cfg):
            return None
        if self.server is None:
            self.server = ForkServer(f"tests-{os.getpid()}")
        return self

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    def close(self) -> None:
        """A run's end: the server stays for the next run."""

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture(scope="session", autouse=True)
def shared_fork_server(request):
    """Session-wide (module-scoped runs start before any function-scoped fixture), and only where
    runs start: oobleck.elastic.job imports torch, which the fast tier need not pay for."""
    if not any(item.get_closest_marker("slow") is not None for item in request.session.items):
        yield None
        return
    from oobleck.elastic import job

    shared = _SharedForkServer()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(job, "fork_server_for", shared.for_run)
        try:
            yield shared
        finally:
            shared.shutdown()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # With ``-n 3 --dist loadgroup`` (the README's test command) every module is one xdist group,
    # so its module-scoped runs happen once, on one worker; modules that share something beyond
    # their own processes name a group themselves (``pytest.mark.xdist_group``, e.g. the tests
    # that give local nodes addresses of their own) and run one after another on one worker.
    # tryfirst: xdist turns the group mark into the item's node id in its own hook of this name,
    # which pytest would otherwise call before this one (a conftest registers before xdist's
    # worker plugin), and the groups would silently not exist.
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    # Groups with a multi-process test first: xdist hands groups out in this order, so the long
    # ones start early and the many short ones fill the workers' ends instead of one long group
    # running alone while the other workers idle (longest first, as in list scheduling).
    slow = {_group(item) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: _group(item) not in slow)


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return mark.kwargs.get("name", mark.args[0] if mark.args else "")
