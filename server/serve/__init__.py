"""The manager of Parrot serve: sessions, semantic variables, the dataflow graph, scheduling and execution.

`server.serve.transforms` holds the declarative output transforms applied to each call's output.
"""
