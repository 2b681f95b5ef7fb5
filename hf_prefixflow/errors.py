"""The one exception type PrefixFlow raises for bad input and unsupported configurations."""


class PrefixFlowError(ValueError):
    """Input or configuration PrefixFlow cannot train exactly; the message names the fix."""
