"""Control plane: the controller (``controller``: the store, the parts, the loop; ``startup``: the
run's start) and its core (``execution``: decisions carried out by kind; ``publishing``: one plan
document per generation); what it reports
(``events``: event kinds and observer hooks; ``accounting``: recoveries and summary.json); the
store host, membership (with ``node_probes``: boot waits, error reports, data-plane reachability)
and the torch-free node agent with its wire protocol (``protocol``), the step ledger, fault
firing, the worker watchdog (``watchdog``: its rules; ``worker_verdicts``: what the controller
does about them), the checkpoint coordinator, stopping; the local and Slurm launchers
(``oobleck.launcher`` is their interface) and the local fork server (``forkserver``; its loop:
``forkserver_loop``; the agent's side: ``forked_worker``); and ``job.launch``, which
runs one training job end to end (what ``python -m oobleck.run`` calls)."""
