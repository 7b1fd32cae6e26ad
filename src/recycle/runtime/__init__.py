"""The runtime: launcher/coordinator, worker executor, data, reference run on torch.distributed."""
