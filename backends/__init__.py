"""Implementations of the indexer ops. Each subpackage is a plugin registering through the same hook.

`backends` is an implementation detail of the dispatch-dsa distribution, not an API: import from
`dispatch`. Its top-level name is generic, so dispatch checks on load that the `backends` Python
found is this one (dispatch.contract.host.builtin_plugins) and names the file when it is not.
"""

DISPATCH_DSA_BUILTIN_BACKENDS = True
