"""Control plane: the controller (store, membership, plans per generation, fault injection, outputs),
the torch-free node agent, the agent wire protocol, local launching, and ``job.launch`` which runs
one training job end to end (what ``python -m oobleck.run`` calls)."""
