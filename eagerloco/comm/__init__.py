"""Transports between workers: in-process (simulated link) and torch.distributed."""
