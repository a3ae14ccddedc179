"""`python -m dlm_engine.parallel.worker_main '<spec json>'`: one worker rank (workers.py)."""

import json
import logging
import os
import sys

from .workers import worker_main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    code = worker_main(json.loads(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: the process group's threads need none
