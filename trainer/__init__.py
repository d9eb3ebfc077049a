"""The learner: consumes version-stamped transitions and publishes weights."""
