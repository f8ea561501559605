"""Reports in: the Report servicer, one stream after its hello, who may report for which pod,
the per-stream rate limit, and the validation of what agents send (docs/architecture.md)."""
