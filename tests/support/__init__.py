"""Shared test helpers: databases, servers and clients."""
