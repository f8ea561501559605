"""Leader election: the elector's decisions and its flags (pure), the leader's label on its own
pod, what agents wrote before a take-over, and the Kubernetes adapters of the Lease and of the
leader's pods."""
