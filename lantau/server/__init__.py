"""Serving: OpenAI and KServe v2 routes over HTTP and gRPC."""
