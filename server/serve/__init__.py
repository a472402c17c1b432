"""The manager of Parrot serve: sessions, semantic variables, the dataflow graph, scheduling and execution.

The decisions are pure data structures and functions with no I/O — the call IR (`ir`), a session's
variables (`variables`) and dataflow graph (`graph`), deduction of objectives (`deduction`), output
transforms (`transforms`), scheduling (`scheduler`), length prediction (`length_predictor`), Mutel's
balancer (`mutel`) — so the simulator (`server.sim`) drives the same code. The `Manager` (`manager`) and
placement (`placement`) run them against engines; the other engine kinds live here too (remote,
disaggregated, an OpenAI-compatible upstream, Ray-placed). See docs/architecture.md.
"""
