"""Stand-in for ``optimum.neuron`` (optimum-neuron 0.4.6.dev4; ``optimum`` is a namespace package
there and here): its submodules only, nothing imported here. optimum-neuron cannot be installed
here."""
