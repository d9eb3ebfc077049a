"""The robot-side safety watchdog. Imports nothing else of edgerl."""
