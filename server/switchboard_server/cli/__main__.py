"""``python -m switchboard_server.cli`` is the ``switchboard`` command."""

from __future__ import annotations

import sys

from switchboard_server.cli.entry import main

sys.exit(main())
