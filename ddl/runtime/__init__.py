"""The worker's runtime: engine, negotiation client, steady-state cycles, response cache, execution, results, timeline."""
