"""Backends serving routed_experts: `reference` (pure torch + torch.distributed) and `cuda`."""
