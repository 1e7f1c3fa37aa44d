"""The training runtime on each rank: the PipelineModule, the trainer loop, checkpoints, the
non-finite guard, stage timing, RNG state, the step log, precision checks, the reference loop."""
