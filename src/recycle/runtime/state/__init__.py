"""A stage's training state and where it goes: the optimizer, StageState, checkpoints, the roll-back snapshot, live
transfer to a replacement and layer migration."""
