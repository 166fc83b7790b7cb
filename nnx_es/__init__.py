"""nnx_es: an event-sourced training runtime for PyTorch."""
