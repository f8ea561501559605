"""The Kubernetes API emulator (``emulator.py``) and what runs beside it in-process."""
