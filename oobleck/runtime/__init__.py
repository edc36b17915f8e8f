"""Worker side of real training: generation-scoped communication (``comm``), the plan's meaning for
communication (``topology``), the interpreter of each rank's schedule with gradient sync and
clipping (``executor``; the schedules themselves: ``oobleck.schedules``), the overlapped gradient
reduction (``reducer``), per-layer state and its transfer (``state``), the worker process
(``worker``), the store key protocol shared with the controller (``keys``) and the single-process
reference (``reference``)."""
