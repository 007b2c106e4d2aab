"""Stand-in for ``optimum.neuron.accelerate`` (optimum-neuron 0.4.6.dev4). optimum-neuron cannot
be installed here."""
