"""The worker's runtime, built by ``ddl.init()``: runtime (the object that owns the
rest), engine (the background thread that executes the leader's responses in order),
control (the negotiation client: the gRPC stream to this node's coordinator), cycles and
cache (the steady-state response cache agreed over the data plane), execute (pack, pick a
backend, run, unpack), results, handle (what async calls return), timeline.
"""
