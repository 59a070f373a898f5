"""The hooks a backend plugin implements. Built-in backends use the same hook as third-party ones."""

import pluggy

hookspec = pluggy.HookspecMarker("dispatch")
hookimpl = pluggy.HookimplMarker("dispatch")


@hookspec
def register_backends(register):
    """Register backends by calling register(backend) with a dispatch.contract.backend.Backend for each."""
