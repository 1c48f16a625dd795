"""Training: the configuration, optimizers, the step builder, the run and its loop, checkpoints, metrics, meshes and processes."""
