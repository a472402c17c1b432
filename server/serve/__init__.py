"""The manager of Parrot serve: sessions, semantic variables, the dataflow graph, scheduling and execution.

Built so far (issue 3 in progress), all pure data structures and functions with no I/O:
`server.serve.ir` (the call IR: segments, steps, prompt rendering, prefix hashes), `server.serve.variables`
(a session's variables), `server.serve.graph` (the per-session dataflow graph: readiness, activation,
failure propagation) and `server.serve.transforms` (declarative output transforms).
"""
