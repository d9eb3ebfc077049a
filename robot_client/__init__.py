"""Clients of the edge server: streaming sim workers (and, later, robots)."""
