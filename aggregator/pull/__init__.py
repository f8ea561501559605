"""What the aggregator fetches itself: the pull fallback (probes of pods no agent speaks for),
the expiry loop (SILENT after the TTL), and the Serve controller's view from each head."""
