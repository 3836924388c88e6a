"""Replica side: the reference VllmEngine gRPC servicer over the reference engine, and its registration."""
