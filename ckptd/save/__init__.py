"""The save path, in order: staging slots, the committed snapshot, flush rounds to NVMe, progress, uploads."""
