"""Entry points: the ``edgerl`` CLI and the process launchers behind it."""
