"""The request path as a readable list of stages sharing one context:

parse (pure validation) -> prepare (template + tokenize) -> select (instance) -> execute (gRPC) -> respond.
"""
