"""Generated protobuf and grpclib code: generated, do not edit; run scripts/gen_proto.py.

Sources are in proto/. Modules:

- ``grpc_service_pb2`` / ``grpc_service_grpc``: KServe V2 with Triton's extensions
  (package ``inference``, service ``GRPCInferenceService``).
- ``model_config_pb2``: the part of Triton's ModelConfig that xlaserve fills.
- ``xlaserve_control_pb2`` / ``xlaserve_control_grpc``: xlaserve's worker control service
  (package ``xlaserve.control``, service ``WorkerControl``).

Message classes are protobuf's upb-backed classes; ``*_grpc`` modules hold grpclib service bases
and stubs. Descriptors live in ``POOL``, not protobuf's default pool, so that tritonclient's own
generated code (same file and message names) can be imported in the same process.
"""

from google.protobuf import descriptor_pool as _descriptor_pool

POOL = _descriptor_pool.DescriptorPool()
