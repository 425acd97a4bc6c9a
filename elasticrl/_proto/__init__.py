"""Generated protobuf and gRPC modules (make proto). Never edit by hand."""
