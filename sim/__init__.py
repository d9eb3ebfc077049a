"""Simulated envs and robots (MuJoCo through gymnasium). Knows nothing of gRPC."""
