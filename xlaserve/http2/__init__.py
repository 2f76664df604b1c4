"""xlaserve's HTTP/2 (RFC 9113): the frames and HPACK codec (:mod:`.frames`, :mod:`.hpack`) and one
sans-IO connection state machine (:mod:`.connection`) with a server mode (driven by the gRPC
server, :mod:`xlaserve.frontend.grpc_server`) and a client mode (the gateway's connections to
workers, :mod:`xlaserve.gateway.upstream`)."""
