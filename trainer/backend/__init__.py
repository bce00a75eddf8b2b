"""The training backend: step functions (steps.py), FSDP2 + compile (parallel.py), model loading, packed attention,
futures, checkpoints and export. Everything that touches the model's parameters lives here."""
