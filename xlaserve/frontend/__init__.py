"""The gRPC frontend (xlaserve's own HTTP/2 server on Trio, grpclib-shaped handlers) and its bridge to the actors."""
