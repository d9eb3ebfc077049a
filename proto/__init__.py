"""The edgerl wire contract: generated messages and tensor (de)serialisation."""
