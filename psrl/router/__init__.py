"""The router: worker registry, instance selection, and the HTTP front (OpenAI + /generate) over gRPC."""
