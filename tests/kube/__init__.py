"""The Kubernetes side of the tests: an API emulator (kmock, extended) and its fixtures."""
