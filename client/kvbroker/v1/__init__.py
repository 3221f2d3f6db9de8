"""Generated protobuf and gRPC code for kvbroker.v1 (do not edit; run proto/generate.py)."""
