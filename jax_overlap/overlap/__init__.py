"""What hides communication: gradient buckets, the FSDP window, XLA flag presets."""
