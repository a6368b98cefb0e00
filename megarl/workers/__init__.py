"""Megatron-side roles: ActorWorker, CriticWorker, ReferenceWorker (megarl/workers/{actor,critic,reference}.py).

megarl.config is imported first: it composes this package's config module, and importing that
module on its own would otherwise enter the import cycle from the wrong end.
"""
import megarl.config  # noqa: F401  (import order, see above)
