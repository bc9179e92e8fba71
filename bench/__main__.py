"""``python -m bench``: see ``bench/run.py``."""

from __future__ import annotations

import os
import sys

# gRPC core logs an INFO line when the harness forks (pg_ctl, git) while its
# channels are open; keep the progress output readable.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from bench.run import main

if __name__ == "__main__":
    sys.exit(main())
