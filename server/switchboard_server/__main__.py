"""``python -m switchboard_server`` is the ``switchboard`` command."""

from __future__ import annotations

import sys

from switchboard_server.cli import main

sys.exit(main())
