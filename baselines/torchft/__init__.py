"""torchft (PyTorch's fault-tolerance library, ``torchft==0.2.0``, the ``[peers]`` extra) as an
external peer: ``policy`` (the harness's decisions), ``service`` (the lighthouse the controller
runs) and ``worker`` (one replica group per node on torchft's real Manager)."""

from baselines.torchft.policy import Torchft, TorchftConfig

__all__ = ["Torchft", "TorchftConfig"]
