"""gRPC servicers: translate protobuf <-> domain objects, and domain errors -> gRPC status. Nothing else."""
