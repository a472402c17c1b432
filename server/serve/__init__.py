"""The manager of Parrot serve: sessions, semantic variables, the dataflow graph, scheduling and execution.

Built so far (issue 3 in progress): `server.serve.ir`, the call IR (segments, steps, prompt rendering and
prefix hashes), and `server.serve.transforms`, the declarative output transforms applied to each output.
"""
