"""Planning: pipeline templates, instantiation, batch distribution and reconfiguration.

Pure Python (numpy at most): this package never imports torch.distributed, so the planner runs
the same in workers, the controller, the simulator and the CLI.
"""
