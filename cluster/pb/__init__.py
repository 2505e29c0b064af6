"""Generated gRPC/protobuf code for proto/pdserve/v1 (regenerate with `make proto`).

    from cluster.pb import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
"""
from cluster.pb.pdserve.v1 import generation_pb2, generation_pb2_grpc

__all__ = ["generation_pb2", "generation_pb2_grpc"]
