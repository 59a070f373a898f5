"""The project's errors. The CLI is the one place that turns them into messages and exit codes."""


class DispatchError(Exception):
    """Base class of every error dispatch raises on purpose."""


class InvalidKeyError(DispatchError, ValueError):
    """A dispatch key names a value that does not exist or cannot occur on real hardware."""


class RegistryError(DispatchError):
    """registry.yaml is unreadable or invalid; the message names file, line and key."""


class PluginError(DispatchError):
    """A plugin failed to load or registered an invalid or duplicate backend."""


class NoBackendError(DispatchError):
    """No registered backend can serve the key; the message lists every candidate's reason."""


class InvalidBatchError(DispatchError, ValueError):
    """A PagedBatch that cannot occur: names the field, and the request when one request is at fault."""


class LayoutError(DispatchError, ValueError):
    """Tensors handed to a backend do not match the layout its decision was tagged with."""


class UnservedCallError(LayoutError):
    """A backend's kernel cannot serve this call (its k, rows or row starts); names the backend and why."""


class DtypeMismatchError(DispatchError, ValueError):
    """Q and the K cache were quantised to different fp8 dtypes."""


class GraphMismatchError(DispatchError):
    """A batch replayed on a captured CUDA graph does not match the decision the graph was captured with."""


class RankDisagreementError(DispatchError):
    """Ranks of one model chose different backends or hold different registries."""


class BackendError(DispatchError):
    """The decided backend raised while running; names backend, op, key and rule, chained to the cause."""


class IndexBoundsError(DispatchError, IndexError):
    """An engine passed a page, position or length outside the tensor it indexes; names request, token and bound."""


class OptionError(DispatchError, ValueError):
    """A command-line option's value cannot be used (a path that cannot be written, a number out of range); names it."""


class EngineVersionError(PluginError):
    """An engine plugin was loaded into an engine release it was not written and tested against."""
