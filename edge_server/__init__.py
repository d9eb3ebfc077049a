"""The edge server: batches observations from many streams and runs the policy."""
