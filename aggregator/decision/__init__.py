"""The pure core: one record per pod and its transitions, what a report, a pull or a silence
does, self-protection (PANIC), the write rule, the override, shadow mode and the serve view.
No I/O and no adapter (import contracts in pyproject.toml)."""
