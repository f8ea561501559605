"""Code shared by the node agent and the aggregator: states, proxy classification, settings."""
