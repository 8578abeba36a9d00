"""Metrics: plain-Python figures (stats), NVML readings (gpu), their Prometheus export."""
