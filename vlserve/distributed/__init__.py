"""torch.distributed plumbing for tensor parallelism: the process group of this process's ranks and its collectives."""
