"""The HTTP listener (``SWITCHBOARD_HTTP_LISTEN``): metrics and the board."""
