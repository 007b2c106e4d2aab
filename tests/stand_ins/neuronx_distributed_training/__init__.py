"""Stand-in for the package ``neuronx_distributed_training`` (NxD Training 1.6.0): only the model
base class's optimizer setup and the checkpoint IO, the parts that call NxD. NxD Training cannot be
installed here (it needs neuronx-distributed, whose PyPI package is an empty placeholder)."""
