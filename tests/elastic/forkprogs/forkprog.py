"""A stand-in worker for tests/elastic/test_forkserver.py: prints what a forked process is (one
JSON line), then exits with the code given, or sleeps until it is killed."""

import json
import logging
import os
import sys
import time

what = {
    "pid": os.getpid(),
    "pgid": os.getpgrp(),
    "cwd": os.getcwd(),
    "marker": os.environ.get("FORKPROG_MARKER"),
    "argv": sys.argv[1:],
    "cmdline": open(f"/proc/{os.getpid()}/cmdline", "rb").read().rstrip(b"\0").decode(),
    "name": __name__,
    # what a server forked from a launcher must not pass on: its logging handlers, its stream
    # wrappers, its descriptors (the worker's own are 0-2 and the listing's)
    "root_handlers": len(logging.getLogger().handlers),
    "stdout_fd": sys.stdout.fileno(),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
}
print(json.dumps(what), flush=True)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "raise":
    raise RuntimeError("forkprog was asked to fail")
time.sleep(120)  # killed by the test long before
