"""Generated protobuf and gRPC modules of the lowcomm.v1 wire protocol (see gen_proto.py)."""
