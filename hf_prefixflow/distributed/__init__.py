"""Rules that let the three-phase schedule ride on data-parallel engines (DDP, DeepSpeed ZeRO, FSDP2)."""
