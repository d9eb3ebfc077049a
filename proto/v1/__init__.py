"""Generated code for ``edgerl/v1/edge.proto`` (do not edit; see ``edgerl.proto.generate``)."""
