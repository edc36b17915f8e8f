import pytest

from oobleck.metrics.offline import private_wandb_dirs


@pytest.fixture(autouse=True)
def _wandb_dirs(tmp_path_factory, monkeypatch):
    for name, value in private_wandb_dirs(tmp_path_factory.mktemp("wandb-home")).items():
        monkeypatch.setenv(name, value)
