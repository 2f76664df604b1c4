"""The gRPC frontend (grpclib, asyncio) and its one bridge to the Trio actors."""
