"""Stand-in for ``neuronx_distributed_training.lightning_modules.model`` (NxD Training 1.6.0). NxD
Training cannot be installed here."""
