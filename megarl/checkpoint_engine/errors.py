"""The error every rank raises when a sync fails (torch-free: the package's front imports it)."""


class WeightSyncError(RuntimeError):
    """A sync failed on some rank; every engine aborted the update (raised on every rank)."""
