"""Worker side of real training: generation-scoped communication (``comm``; its abortable waits:
``waits``; aborted groups' disposal: ``reaper``; store connections: ``store_client``), the plan's
meaning for communication (``topology``), the interpreter of each rank's schedule with gradient
sync and clipping (``executor``; the schedules themselves: ``oobleck.schedules``), the overlapped
gradient reduction (``reducer``), the transfer of layer state between workers (``transfer``; the
state itself is ``oobleck.layer_state``), the worker process (``worker``; its waits on the
controller's store: ``control``; what it holds: ``resources``), the torch-free protocol shared
with the controller (``keys``, the store's key space, and ``plan_document``, what each generation
publishes) and the single-process reference (``reference``)."""
