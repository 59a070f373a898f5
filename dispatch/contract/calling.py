"""Calling a backend: its own failures surface as BackendError naming what chose it.

The project's own errors (LayoutError and DtypeMismatchError from a backend's input checks) and CUDA
out-of-memory pass through unchanged. There is no fallback to another backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from dispatch.contract.errors import BackendError, DispatchError

if TYPE_CHECKING:
    from dispatch.contract.decision import Decision


def call_backend(decision: Decision, *args: Any, entry: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """Call `entry` (default: the decided backend's `run`) and name the backend if it fails."""
    import torch  # here, not at the top: the contract loads without torch (`validate` runs without it)

    function = entry or decision.impl.run
    try:
        return function(*args, **kwargs)
    except (DispatchError, torch.cuda.OutOfMemoryError):
        # Project errors already say what is wrong in the project's terms; running out of memory is
        # the engine's to handle (it catches it by type to shrink or preempt), not a backend fault.
        raise
    except Exception as error:
        # No retry on another backend: a different path mid-batch would change the numerics between
        # layers of one forward and between ranks that must agree, and it would hide the fault.
        # (A fault on the device itself may surface only at a later synchronisation, outside this call.)
        stage = "preparing a batch for" if entry is not None else "running"
        raise BackendError(
            f"backend `{decision.backend}` (plugin `{decision.plugin}`) raised {type(error).__name__} {stage} "
            f"{decision.op.value} at {decision.key}, chosen by {decision.chosen_by}: {error}"
        ) from error
