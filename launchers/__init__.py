"""How ranks come to exist: ``local`` (torch.distributed.elastic on this machine)."""
