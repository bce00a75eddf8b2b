"""Functional FSDP2 + torch.compile trainer, rollouts and loops."""
