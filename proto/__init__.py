"""The edgerl wire contract: generated messages and tensor (de)serialisation; and what the server
and its clients set up the same way (keepalive, PEM files, the checks of settings)."""
