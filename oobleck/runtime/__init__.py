"""Worker side of real training: generation-scoped communication (``comm``), the plan's meaning for
communication (``topology``), the 1F1B executor with gradient sync and clipping (``executor``),
per-layer state and its transfer (``state``), the worker process (``worker``), the store key
protocol shared with the controller (``keys``) and the single-process reference (``reference``)."""
