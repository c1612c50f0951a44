"""The data plane: tensor bytes between ranks, never through gRPC.

backends (the seam the runtime calls; ``backends/__init__.py`` holds the ordered list that
picks one per call), algorithms (ring, recursive doubling, hierarchical, shared-memory
collectives: functions of buffer, op, group and transport), transports (bytes between
ranks: shared memory, TCP). Imports only itself and ``ddl.core``.
"""
