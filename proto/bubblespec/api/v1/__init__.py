"""Generated protobuf and gRPC stubs of the BubbleSpec v1 API (see rollout.proto)."""
